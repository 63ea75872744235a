// The CPU handlers of the telemetry targets (ffi_targets.h): numbering a GEMM's executions and recording its
// statistics on the host (telemetry_sink.h). Neither touches the program's values.
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_fp4/cpu_kernels.h"
#include "xla_fp4/ffi_targets.h"
#include "xla_fp4/telemetry_sink.h"

namespace xla_fp4::cpu {
namespace {

namespace ffi = xla::ffi;
using telemetry::Sink;

ffi::Error TelemetryStep(int32_t device, ffi::Buffer<ffi::S32> block, ffi::ResultBuffer<ffi::S32> step, int64_t module,
                         int64_t site, int64_t every) {
  step->typed_data()[0] = Sink::Get().Step(module, site, block.typed_data()[0], device, every);
  return ffi::Error::Success();
}

ffi::Error TelemetryRecord(int32_t device, ffi::Buffer<ffi::F32> stats, ffi::Buffer<ffi::S32> step,
                           ffi::Buffer<ffi::S32> block, ffi::ResultBuffer<ffi::S32> done, int64_t module, int64_t site,
                           int64_t strict_row) {
  done->typed_data()[0] = step.typed_data()[0];
  if (step.typed_data()[0] < 0) return ffi::Error::Success();  // not a recorded step
  const float* v = stats.typed_data();
  telemetry::Record record{module, site, block.typed_data()[0], step.typed_data()[0], device,
                           std::vector<float>(v, v + stats.element_count())};
  std::string error = telemetry::AllZeroMessage(record, strict_row);
  Sink::Get().Add(std::move(record));
  if (!error.empty()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, error);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xla_fp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4TelemetryStepCpu, xla_fp4::cpu::TelemetryStep,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block: the scanned stack's iteration, or -1
                                  .Ret<ffi::Buffer<ffi::S32>>()  // step: this call's, or -1 (not recorded)
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_TELEMETRY_STEP_ATTRIBUTES));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaFp4TelemetryRecordCpu, xla_fp4::cpu::TelemetryRecord,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // statistics: rows of telemetry::kNumFields
                                  .Arg<ffi::Buffer<ffi::S32>>()  // step
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block
                                  .Ret<ffi::Buffer<ffi::S32>>()  // the step, passed through
                                  XLA_FP4_BIND_ATTRIBUTES(XLA_FP4_TELEMETRY_RECORD_ATTRIBUTES));
