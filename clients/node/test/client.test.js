'use strict';
// Runs against a real server: KERNELEVAL_ADDRESS (and KERNELEVAL_ADMIN_TOKEN for the
// operations calls). tests/clients/test_client_node.py starts one and runs `node --test`.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const fs = require('node:fs');
const os = require('node:os');
const { execFile } = require('node:child_process');
const { KernelEvalClient, detectKernelType, grpc } = require('../src/client');

const ADDRESS = process.env.KERNELEVAL_ADDRESS;
const skip = ADDRESS ? false : 'KERNELEVAL_ADDRESS is not set (no server to test against)';

const MODEL = `import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2.0 + 1.0

def get_inputs():
    return [torch.randn(256)]

def get_init_inputs():
    return []
`;
const FAST = { correct_trial_count: 2, perf_trial_count: 5, warmup_count: 1 };
const spec = (source = MODEL) => ({
  kernel: { type: detectKernelType(source), source_code: source },
  options: FAST,
  client_tag: 'node-test',
});

test('kerneleval from Node', { skip }, async (t) => {
  const client = new KernelEvalClient(ADDRESS, { deadlineSeconds: 240 });
  t.after(() => client.close());

  await t.test('Evaluate returns the finished job', async () => {
    const job = await client.evaluate(spec());
    assert.equal(job.state, 'JOB_STATE_DONE');
    assert.equal(job.result.verdict, 'VERDICT_OK');
    assert.ok(job.result.runtime.median_ms > 0);
  });

  await t.test('Run streams every event in order, then Watch replays them', async () => {
    const events = [];
    for await (const e of client.run(spec())) events.push(e);
    assert.deepEqual(events.map((e) => e.sequence), events.map((_, i) => i + 1));
    assert.equal(events[0].kind, 'queued');
    assert.ok(events.some((e) => e.kind === 'phase' && e.phase.phase === 'PHASE_VALIDATING'));
    const last = events[events.length - 1];
    assert.equal(last.kind, 'finished');
    assert.equal(last.finished.result.verdict, 'VERDICT_OK');
    const replay = [];
    for await (const e of client.watch(last.job_id, 2)) replay.push(e.sequence);
    assert.deepEqual(replay, events.slice(2).map((e) => e.sequence));
  });

  await t.test('bad input is INVALID_ARGUMENT with field violations', async () => {
    const bad = spec();
    bad.kernel.type = 'KERNEL_TYPE_UNSPECIFIED';
    await assert.rejects(client.evaluate(bad), (err) => {
      assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
      assert.ok(err.fieldViolations.some((v) => v.field === 'spec.kernel.type'), JSON.stringify(err.fieldViolations));
      return true;
    });
  });

  await t.test('an unknown job is NOT_FOUND', async () => {
    await assert.rejects(client.getJob('no-such-job'), (err) => err.code === grpc.status.NOT_FOUND);
  });

  await t.test('ListJobs filters by tag', async () => {
    const page = await client.listJobs({ client_tag: 'node-test', page_size: 2 });
    assert.ok(page.jobs.length >= 1 && page.jobs.length <= 2);
    assert.ok(page.jobs.every((j) => j.state === 'JOB_STATE_DONE'));
  });

  await t.test('operations need the admin token', { skip: !process.env.KERNELEVAL_ADMIN_TOKEN }, async () => {
    const devices = await client.listDevices();
    assert.ok(devices.length >= 1);
    const builders = await client.listBuilders(); // SQLite, --role all: none
    assert.deepEqual(builders.builders, []);
    const anonymous = new KernelEvalClient(ADDRESS, { adminToken: 'wrong' });
    await assert.rejects(anonymous.listDevices(), (err) => err.code === grpc.status.UNAUTHENTICATED);
    anonymous.close();
  });

  await t.test('the example evaluates a file and follows the stream', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kerneleval-node-'));
    const file = path.join(dir, 'model.py');
    fs.writeFileSync(file, MODEL);
    const example = path.join(__dirname, '..', 'examples', 'evaluate.js');
    const { stdout } = await new Promise((resolve, reject) => {
      execFile(process.execPath, [example, file, file], { timeout: 240000 }, (err, out, errOut) =>
        (err ? reject(new Error(`${err.message}\n${out}\n${errOut}`)) : resolve({ stdout: out })));
    });
    assert.match(stdout, /Evaluate: job \S+ JOB_STATE_DONE verdict VERDICT_OK/);
    assert.match(stdout, /#1 queued/);
    assert.match(stdout, /finished: JOB_STATE_DONE/);
    assert.match(stdout, /verdict: VERDICT_OK/);
    assert.match(stdout, /speedup: /);
  });
});
