'use strict';
// Against a service with tenants (--tenants-file): KERNELEVAL_ADDRESS, the tokens of two of
// its tenants (KERNELEVAL_TENANT_TOKEN, KERNELEVAL_OTHER_TENANT_TOKEN) and the first one's
// name (KERNELEVAL_TENANT_NAME). tests/clients/test_client_languages.py starts one.

const test = require('node:test');
const assert = require('node:assert/strict');
const { KernelEvalClient, grpc } = require('../src/client');

const ADDRESS = process.env.KERNELEVAL_ADDRESS;
const TOKEN = process.env.KERNELEVAL_TENANT_TOKEN;
const OTHER = process.env.KERNELEVAL_OTHER_TENANT_TOKEN;
const NAME = process.env.KERNELEVAL_TENANT_NAME;
const skip = ADDRESS && TOKEN && OTHER && NAME ? false : 'no service with tenants to test against';

const spec = {
  kernel: {
    type: 'KERNEL_TYPE_TORCH',
    source_code: 'import torch\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n'
      + '        return x + 1.0  # node tenant test\n\ndef get_inputs():\n'
      + '    return [torch.randn(16)]\n\ndef get_init_inputs():\n    return []\n',
  },
  options: { correct_trial_count: 1, perf_trial_count: 1, warmup_count: 1 },
  client_tag: 'node-tenant',
};

test('the Node.js client sends a tenant token', { skip }, async (t) => {
  // KERNELEVAL_TENANT_TOKEN is the default: a client given none sends it.
  const fromEnv = new KernelEvalClient(ADDRESS, { deadlineSeconds: 60 });
  t.after(() => fromEnv.close());
  assert.equal(fromEnv.tenantToken, TOKEN);
  const mine = new KernelEvalClient(ADDRESS, { tenantToken: TOKEN, deadlineSeconds: 60 });
  const theirs = new KernelEvalClient(ADDRESS, { tenantToken: OTHER, deadlineSeconds: 60 });
  const wrong = new KernelEvalClient(ADDRESS, { tenantToken: 'ket_guessed', deadlineSeconds: 60 });
  const none = new KernelEvalClient(ADDRESS, { tenantToken: '', deadlineSeconds: 60 });
  t.after(() => [mine, theirs, wrong, none].forEach((c) => c.close()));

  const job = await mine.submit(spec);
  await t.test('its jobs are its tenant\'s', async () => {
    assert.equal(job.tenant, NAME);
    assert.equal((await mine.getJob(job.job_id)).job_id, job.job_id);
    const page = await mine.listJobs({ client_tag: 'node-tenant' });
    assert.deepEqual(page.jobs.map((j) => j.job_id), [job.job_id]);
  });
  await t.test('another tenant\'s token does not see them (NOT_FOUND)', async () => {
    await assert.rejects(theirs.getJob(job.job_id), (err) => err.code === grpc.status.NOT_FOUND);
    assert.deepEqual((await theirs.listJobs({ client_tag: 'node-tenant' })).jobs, []);
  });
  await t.test('no token, or a wrong one, is UNAUTHENTICATED', async () => {
    for (const c of [none, wrong]) {
      await assert.rejects(c.getJob(job.job_id), (err) => err.code === grpc.status.UNAUTHENTICATED);
      await assert.rejects(c.submit(spec), (err) => err.code === grpc.status.UNAUTHENTICATED);
    }
  });
});
