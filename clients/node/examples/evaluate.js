#!/usr/bin/env node
'use strict';
// Evaluates a kernel file (compares it when a reference file is given) and follows Run's
// stream to the result.
//   node examples/evaluate.js KERNEL_FILE [REFERENCE_FILE]
// Server address: $KERNELEVAL_ADDRESS (default 127.0.0.1:50051). Exit code 0 when the
// verdict is OK, 1 otherwise, 3 when the service refused the job or could not be reached.

const fs = require('node:fs');
const path = require('node:path');
const { KernelEvalClient, detectKernelType } = require('../src/client');

function kernelSource(file) {
  const source = fs.readFileSync(file, 'utf8');
  return { type: detectKernelType(source, path.basename(file)), source_code: source };
}

function describe(event) {
  switch (event.kind) {
    case 'queued': return `queued (position ${event.queued.position})`;
    case 'started': return `started on worker ${event.started.worker_id} (device ${event.started.device_index})`;
    case 'phase': return `phase ${event.phase.phase.replace('PHASE_', '').toLowerCase()}`;
    case 'progress': return `  ${event.progress.done_count}/${event.progress.total_count}`;
    case 'log': return `  | ${event.log.text.trimEnd()}`;
    case 'fault': return `fault: ${event.fault.description}`;
    case 'finished': return `finished: ${event.finished.state}`;
    default: return event.kind;
  }
}

async function main() {
  const [kernelFile, referenceFile] = process.argv.slice(2);
  if (!kernelFile) {
    console.error('usage: node examples/evaluate.js KERNEL_FILE [REFERENCE_FILE]');
    return 2;
  }
  const spec = {
    kernel: kernelSource(kernelFile),
    options: { correct_trial_count: 2, perf_trial_count: 10, warmup_count: 2 },
    client_tag: 'node-example',
  };
  if (referenceFile) spec.reference = kernelSource(referenceFile);
  const client = new KernelEvalClient();
  try {
    // Unary: one call, the finished job.
    const job = await client.evaluate(spec);
    console.log(`Evaluate: job ${job.job_id} ${job.state} verdict ${job.result.verdict}`);

    // Streaming: every event of a second run, then its result.
    let finished = null;
    for await (const event of client.run(spec)) {
      console.log(`#${event.sequence} ${describe(event)}`);
      if (event.kind === 'finished') finished = event.finished;
    }
    const r = finished.result;
    console.log(`verdict: ${r.verdict}`);
    console.log(`compiled: ${r.compiled}  correct: ${r.correctness}`);
    if (r.runtime) console.log(`median: ${r.runtime.median_ms.toFixed(4)} ms over ${r.runtime.trial_count} trials`);
    if (r.speedup) console.log(`speedup: ${r.speedup.toFixed(3)}x`);
    if (r.compilation_error) console.log(`compile error: ${r.compilation_error}`);
    if (r.error && r.error.message) console.log(`error: ${r.error.exception_type}: ${r.error.message}`);
    return r.verdict === 'VERDICT_OK' ? 0 : 1;
  } catch (err) {
    console.error(`error: ${err.message}`);
    for (const v of err.fieldViolations || []) console.error(`  ${v.field}: ${v.description}`);
    return 3;
  } finally {
    client.close();
  }
}

main().then((code) => { process.exitCode = code; });
