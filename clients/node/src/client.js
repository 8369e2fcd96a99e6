'use strict';
// Node.js client of kerneleval: @grpc/grpc-js with the .proto files loaded at run time by
// @grpc/proto-loader (no code generation step). Messages are plain objects with the proto
// field names (keepCase), enums as their names, 64-bit integers as Numbers.

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const DEFAULT_ADDRESS = '127.0.0.1:50051';
const PROTO_DIR = process.env.KERNELEVAL_PROTO_DIR || path.resolve(__dirname, '..', '..', '..', 'proto');
const LOADER_OPTIONS = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };
// Codes after which a followed job's stream is re-attached with Watch(after_sequence).
const REATTACH_CODES = new Set([grpc.status.UNAVAILABLE, grpc.status.CANCELLED, grpc.status.ABORTED]);

// google.rpc.Status and BadRequest, to decode the field violations of INVALID_ARGUMENT
// (the trailer grpc-status-details-bin) without shipping googleapis' protos.
const RPC_TYPES = protobuf.parse(`
syntax = "proto3";
package google.rpc;
message Any { string type_url = 1; bytes value = 2; }
message Status { int32 code = 1; string message = 2; repeated Any details = 3; }
message BadRequest {
  message FieldViolation { string field = 1; string description = 2; }
  repeated FieldViolation field_violations = 1;
}`, { keepCase: true }).root;

function loadApi(protoDir = PROTO_DIR) {
  const definition = protoLoader.loadSync(
    ['kerneleval/v1/kernel_eval_service.proto', 'kerneleval/v1/operations_service.proto'],
    { ...LOADER_OPTIONS, includeDirs: [protoDir] },
  );
  return grpc.loadPackageDefinition(definition).kerneleval.v1;
}

// The BadRequest field violations carried by a gRPC error: [{field, description}].
function fieldViolations(err) {
  const raw = err && err.metadata ? err.metadata.get('grpc-status-details-bin') : [];
  if (!raw.length) return [];
  try {
    const status = RPC_TYPES.lookupType('google.rpc.Status').decode(raw[0]);
    const out = [];
    for (const detail of status.details) {
      if (!detail.type_url.endsWith('/google.rpc.BadRequest')) continue;
      const bad = RPC_TYPES.lookupType('google.rpc.BadRequest').decode(detail.value);
      for (const v of bad.field_violations) out.push({ field: v.field, description: v.description });
    }
    return out;
  } catch {
    return [];
  }
}

function withViolations(err) {
  if (err && err.code === grpc.status.INVALID_ARGUMENT) err.fieldViolations = fieldViolations(err);
  return err;
}

function promisify(client, method, request, options) {
  return new Promise((resolve, reject) => {
    client[method](request, options.metadata || new grpc.Metadata(), options.callOptions || {},
      (err, response) => (err ? reject(withViolations(err)) : resolve(response)));
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

class KernelEvalClient {
  constructor(address = process.env.KERNELEVAL_ADDRESS || DEFAULT_ADDRESS, options = {}) {
    const api = loadApi(options.protoDir);
    const credentials = options.credentials || grpc.credentials.createInsecure();
    const channelOptions = {
      'grpc.max_receive_message_length': 64 * 1024 * 1024,
      'grpc.max_send_message_length': 64 * 1024 * 1024,
    };
    this.address = address;
    this.adminToken = options.adminToken || process.env.KERNELEVAL_ADMIN_TOKEN || '';
    // A tenant's token (a service with --tenants-file), as the Python client's tenant_token:
    // sent on every KernelEvalService call as `authorization: Bearer <token>` ('' given: none,
    // whatever the environment says).
    this.tenantToken = options.tenantToken ?? (process.env.KERNELEVAL_TENANT_TOKEN || '');
    this.deadlineSeconds = options.deadlineSeconds || 0;
    this.reconnectSeconds = options.reconnectSeconds || 60;
    this.eval = new api.KernelEvalService(address, credentials, channelOptions);
    this.ops = new api.OperationsService(address, credentials, channelOptions);
  }

  close() {
    this.eval.close();
    this.ops.close();
  }

  // Operations calls carry the admin token; KernelEvalService calls the tenant token, else the
  // admin token (which a service with tenants takes too, seeing every job), else nothing.
  _options(admin = false) {
    const metadata = new grpc.Metadata();
    if (admin) {
      if (!this.adminToken) throw new Error('operations calls need an admin token (KERNELEVAL_ADMIN_TOKEN)');
      metadata.set('authorization', `Bearer ${this.adminToken}`);
    } else if (this.tenantToken || this.adminToken) {
      metadata.set('authorization', `Bearer ${this.tenantToken || this.adminToken}`);
    }
    const callOptions = this.deadlineSeconds ? { deadline: Date.now() + this.deadlineSeconds * 1000 } : {};
    return { metadata, callOptions };
  }

  // Evaluates (compares when spec.reference is set); resolves to the finished Job.
  async evaluate(spec) { return (await promisify(this.eval, 'Evaluate', { spec }, this._options())).job; }
  async compare(spec) { return (await promisify(this.eval, 'Compare', { spec }, this._options())).job; }
  async submit(spec) { return (await promisify(this.eval, 'Submit', { spec }, this._options())).job; }
  async getJob(jobId) { return (await promisify(this.eval, 'GetJob', { job_id: jobId }, this._options())).job; }
  async cancelJob(jobId) { return (await promisify(this.eval, 'CancelJob', { job_id: jobId }, this._options())).job; }
  listJobs(request = {}) { return promisify(this.eval, 'ListJobs', request, this._options()); }

  // Submits a job and yields its JobEvents to the last (`finished`), re-attaching with Watch
  // after a dropped stream so that no event is lost or repeated.
  run(spec, { keepOnDisconnect = false } = {}) {
    const { metadata, callOptions } = this._options();
    return this._follow('', 0, () => this.eval.Run({ spec, keep_on_disconnect: keepOnDisconnect }, metadata, callOptions));
  }

  // Yields a job's events after `afterSequence` (0: all) to the last.
  watch(jobId, afterSequence = 0) { return this._follow(jobId, afterSequence, null); }

  async *_follow(jobId, after, open) {
    let last = after;
    let id = jobId;
    let giveUpAt = 0;
    let backoff = 50;
    for (;;) {
      const { metadata, callOptions } = this._options();
      const call = open ? open() : this.eval.Watch({ job_id: id, after_sequence: last }, metadata, callOptions);
      open = null;
      try {
        for await (const response of call) {
          const event = response.event;
          if (!id) id = event.job_id;
          if (event.sequence <= last) continue;
          last = event.sequence;
          giveUpAt = 0;
          backoff = 50;
          yield event;
          if (event.kind === 'finished') return;
        }
      } catch (err) {
        if (!id || !REATTACH_CODES.has(err.code)) throw withViolations(err);
      } finally {
        call.cancel();
      }
      if (!giveUpAt) giveUpAt = Date.now() + this.reconnectSeconds * 1000;
      if (Date.now() >= giveUpAt) throw new Error(`lost the stream of job ${id} after sequence ${last}`);
      await sleep(backoff);
      backoff = Math.min(backoff * 2, 2000);
    }
  }

  // OperationsService (admin token).
  async listDevices() { return (await promisify(this.ops, 'ListDevices', {}, this._options(true))).devices; }
  getStats() { return promisify(this.ops, 'GetStats', {}, this._options(true)); }
  // The builders of a shared store ({builders, versions}: versions are the server's own).
  listBuilders() { return promisify(this.ops, 'ListBuilders', {}, this._options(true)); }
  resetGpu(deviceIndex, graceSeconds = 30) {
    return promisify(this.ops, 'ResetGpu', { device_index: deviceIndex, grace_period: { seconds: graceSeconds } }, this._options(true));
  }
}

// KERNEL_TYPE_* of a source, as the Python client detects it.
function detectKernelType(source, filename = '') {
  if (/\.cuh?$/i.test(filename) || (/__global__\s+\w/.test(source) && !/^\s*(import|from)\s+\w/m.test(source))) return 'KERNEL_TYPE_CUDA';
  if (/@\s*triton\s*\.\s*(jit|autotune|heuristics)\b|\btriton\.jit\s*\(/.test(source)) return 'KERNEL_TYPE_TRITON';
  if (/\bload_inline\s*\(|\bcpp_extension\b/.test(source)) return 'KERNEL_TYPE_TORCH_CUDA';
  return 'KERNEL_TYPE_TORCH';
}

module.exports = { KernelEvalClient, loadApi, fieldViolations, detectKernelType, grpc, DEFAULT_ADDRESS, PROTO_DIR };
