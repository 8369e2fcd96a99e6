// Evaluates a kernel file (compares it when a reference file is given) with the unary
// Evaluate call, then runs it again with Run and follows the stream to the result.
//   kerneleval_evaluate KERNEL_FILE [REFERENCE_FILE]
// Server address: $KERNELEVAL_ADDRESS (default 127.0.0.1:50051; unix:PATH works too); a
// service with tenants: $KERNELEVAL_TENANT_TOKEN, sent with every call.
// Exit code 0 when the verdict is OK, 1 otherwise, 2 for usage, 3 when a call failed.

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <regex>
#include <sstream>
#include <string>

#include "kerneleval/v1/kernel_eval_service.grpc.pb.h"

namespace v1 = kerneleval::v1;

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// The same rules as the Python client's kernelbench.detect_kernel_type.
v1::KernelType DetectType(const std::string& source, const std::string& path) {
  static const std::regex cuda_file(R"(\.cuh?$)", std::regex::icase);
  static const std::regex global(R"(__global__\s+\w)");
  static const std::regex python(R"((^|\n)\s*(import|from)\s+\w)");
  static const std::regex triton(R"(@\s*triton\s*\.\s*(jit|autotune|heuristics)\b|\btriton\.jit\s*\()");
  static const std::regex inline_cuda(R"(\bload_inline\s*\(|\bcpp_extension\b)");
  if (std::regex_search(path, cuda_file) ||
      (std::regex_search(source, global) && !std::regex_search(source, python)))
    return v1::KERNEL_TYPE_CUDA;
  if (std::regex_search(source, triton)) return v1::KERNEL_TYPE_TRITON;
  if (std::regex_search(source, inline_cuda)) return v1::KERNEL_TYPE_TORCH_CUDA;
  return v1::KERNEL_TYPE_TORCH;
}

void SetSource(v1::KernelSource* k, const std::string& path) {
  k->set_source_code(ReadFile(path));
  k->set_type(DetectType(k->source_code(), path));
}

std::string Describe(const v1::JobEvent& e) {
  std::ostringstream s;
  switch (e.kind_case()) {
    case v1::JobEvent::kQueued: s << "queued (position " << e.queued().position() << ")"; break;
    case v1::JobEvent::kStarted:
      s << "started on worker " << e.started().worker_id() << " (device "
        << e.started().device_index() << ")";
      break;
    case v1::JobEvent::kPhase: s << "phase " << v1::Phase_Name(e.phase().phase()); break;
    case v1::JobEvent::kProgress:
      s << "  " << e.progress().done_count() << "/" << e.progress().total_count();
      break;
    case v1::JobEvent::kLog: s << "  | " << e.log().text(); break;
    case v1::JobEvent::kFault: s << "fault: " << e.fault().description(); break;
    case v1::JobEvent::kFinished: s << "finished: " << v1::JobState_Name(e.finished().state()); break;
    default: s << "(unknown event)";
  }
  return s.str();
}

// The tenant's token on a call (a service with --tenants-file), as the other clients send it.
void Authorize(grpc::ClientContext& ctx) {
  const char* token = std::getenv("KERNELEVAL_TENANT_TOKEN");
  if (token && *token) ctx.AddMetadata("authorization", std::string("Bearer ") + token);
}

int Fail(const grpc::Status& status, const char* what) {
  std::cerr << what << " failed: " << status.error_code() << " " << status.error_message() << "\n";
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::cerr << "usage: " << argv[0] << " KERNEL_FILE [REFERENCE_FILE]\n";
    return 2;
  }
  const char* env_address = std::getenv("KERNELEVAL_ADDRESS");
  const std::string address = env_address && *env_address ? env_address : "127.0.0.1:50051";

  v1::JobSpec spec;
  try {
    SetSource(spec.mutable_kernel(), argv[1]);
    if (argc == 3) SetSource(spec.mutable_reference(), argv[2]);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  spec.mutable_options()->set_correct_trial_count(2);
  spec.mutable_options()->set_perf_trial_count(10);
  spec.mutable_options()->set_warmup_count(2);
  spec.set_client_tag("cpp-example");

  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto stub = v1::KernelEvalService::NewStub(channel);

  // Unary: one call, the finished job.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
    Authorize(ctx);
    v1::EvaluateRequest req;
    *req.mutable_spec() = spec;
    v1::EvaluateResponse resp;
    grpc::Status status = stub->Evaluate(&ctx, req, &resp);
    if (!status.ok()) return Fail(status, "Evaluate");
    std::cout << "Evaluate: job " << resp.job().job_id() << " "
              << v1::JobState_Name(resp.job().state()) << " verdict "
              << v1::Verdict_Name(resp.job().result().verdict()) << "\n";
  }

  // Streaming: every event of a second run, then its result.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  Authorize(ctx);
  v1::RunRequest req;
  *req.mutable_spec() = spec;
  std::unique_ptr<grpc::ClientReader<v1::RunResponse>> reader(stub->Run(&ctx, req));
  v1::RunResponse resp;
  v1::Job job;
  bool finished = false;
  while (reader->Read(&resp)) {
    const v1::JobEvent& e = resp.event();
    std::cout << "#" << e.sequence() << " " << Describe(e) << "\n";
    if (e.has_finished()) {
      job = e.finished();
      finished = true;
    }
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return Fail(status, "Run");
  if (!finished) {
    std::cerr << "Run ended without a result\n";
    return 3;
  }
  const v1::EvalResult& r = job.result();
  std::cout << "verdict: " << v1::Verdict_Name(r.verdict()) << "\n"
            << "compiled: " << r.compiled() << "  correct: " << r.correctness() << "\n"
            << "median: " << r.runtime().median_ms() << " ms over " << r.runtime().trial_count()
            << " trials\n";
  if (r.speedup() > 0) std::cout << "speedup: " << r.speedup() << "x\n";
  if (!r.compilation_error().empty()) std::cout << "compile error: " << r.compilation_error() << "\n";
  if (!r.error().message().empty())
    std::cout << "error: " << r.error().exception_type() << ": " << r.error().message() << "\n";
  return r.verdict() == v1::VERDICT_OK ? 0 : 1;
}
