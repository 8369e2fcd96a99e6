'use strict';
// run()/watch() re-attach after a dropped stream: a small in-process grpc-js server whose Run
// fails with UNAVAILABLE after a few events; the client must go on with Watch(after_sequence)
// and see every event exactly once. Needs no kerneleval server.

const test = require('node:test');
const assert = require('node:assert/strict');
const { KernelEvalClient, loadApi, grpc } = require('../src/client');

const KINDS = ['queued', 'started', 'phase', 'progress', 'progress', 'finished'];

function event(jobId, sequence) {
  const kind = KINDS[sequence - 1];
  const e = { job_id: jobId, sequence };
  if (kind === 'queued') e.queued = { position: 0 };
  if (kind === 'started') e.started = { worker_id: 'w0', device_index: -1, attempt: 1 };
  if (kind === 'phase') e.phase = { phase: 'PHASE_VALIDATING' };
  if (kind === 'progress') e.progress = { phase: 'PHASE_VALIDATING', done_count: sequence - 3, total_count: 2 };
  if (kind === 'finished') e.finished = { job_id: jobId, state: 'JOB_STATE_DONE', result: { verdict: 'VERDICT_OK' } };
  return e;
}

function startFake() {
  const api = loadApi();
  const watches = [];
  const server = new grpc.Server();
  server.addService(api.KernelEvalService.service, {
    Run(call) {
      for (let s = 1; s <= 3; s++) call.write({ event: event('job-1', s) });
      call.emit('error', { code: grpc.status.UNAVAILABLE, details: 'connection dropped (test)' });
    },
    Watch(call) {
      watches.push(Number(call.request.after_sequence));
      if (call.request.job_id !== 'job-1') {
        call.emit('error', { code: grpc.status.NOT_FOUND, details: 'no such job' });
        return;
      }
      for (let s = Number(call.request.after_sequence) + 1; s <= KINDS.length; s++) {
        call.write({ event: event('job-1', s) });
      }
      call.end();
    },
  });
  return new Promise((resolve, reject) => {
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, port) => {
      if (err) return reject(err);
      resolve({ server, port, watches });
    });
  });
}

test('run re-attaches with Watch after a dropped stream', async () => {
  const { server, port, watches } = await startFake();
  const client = new KernelEvalClient(`127.0.0.1:${port}`, { reconnectSeconds: 10 });
  try {
    const seen = [];
    for await (const e of client.run({ kernel: { type: 'KERNEL_TYPE_TORCH', source_code: 'x' } })) {
      seen.push([e.sequence, e.kind]);
    }
    assert.deepEqual(seen.map(([s]) => s), [1, 2, 3, 4, 5, 6]);
    assert.deepEqual(seen.map(([, k]) => k), KINDS);
    assert.deepEqual(watches, [3]);

    const replay = [];
    for await (const e of client.watch('job-1', 4)) replay.push(e.sequence);
    assert.deepEqual(replay, [5, 6]);
    await assert.rejects(async () => {
      for await (const e of client.watch('nope')) assert.fail(`unexpected ${e.sequence}`);
    }, (err) => err.code === grpc.status.NOT_FOUND);
  } finally {
    client.close();
    server.forceShutdown();
  }
});
