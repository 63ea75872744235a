// The host side of the telemetry targets (python/xla_fp4/telemetry.py reads it): per-call step counters and the
// statistics recorded since the last drain. One Sink per extension module (the CPU and the CUDA handlers each have
// theirs; Python drains both). Thread-safe: XLA runs the calls of several devices at once.
//
// xla_fp4_telemetry_step (ffi_targets.h) decides on the host, when XLA runs (CPU) or enqueues (CUDA) the call, whether
// this step of a GEMM is recorded: its calls are counted per (module, site, device), `calls` of them per step (a scanned
// stack's GEMM runs once per layer), so every device takes the same decisions, and the record and statistics calls
// after it can skip their work without reading anything back from a device.
#ifndef XLA_FP4_TELEMETRY_SINK_H_
#define XLA_FP4_TELEMETRY_SINK_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "xla_fp4/telemetry_fields.h"

namespace xla_fp4::telemetry {

struct Record {
  int64_t module, site;
  int32_t block, step, device;
  std::vector<float> values;  // rows of kNumFields: the GEMM's operands, then its output's (zeros, elements, ...)
};

// Adds `part` into `sum` (rows of kNumFields, `rows` of them): an operand row's amax and s_dec the largest, its other
// fields (counts, energies) the sum; the last row (the output's zeros and elements) all sums.
inline void AddRows(float* sum, const float* part, int64_t rows) {
  for (int64_t i = 0; i < rows * kNumFields; ++i) {
    const int field = static_cast<int>(i % kNumFields);
    const bool maxed = i / kNumFields < rows - 1 && (field == kAmax || field == kDecodeScale);
    sum[i] = maxed ? std::max(sum[i], part[i]) : sum[i] + part[i];
  }
}

// The rows of one record from a partitioned program's gathered per-device tables: `values` holds `devices` tables of
// `rows` rows each, what one device's shards contribute (a replica's are zeros): the whole tensors' rows.
inline std::vector<float> CombineDevices(const float* values, int64_t devices, int64_t rows) {
  std::vector<float> out(values, values + rows * kNumFields);
  for (int64_t d = 1; d < devices; ++d) AddRows(out.data(), values + d * rows * kNumFields, rows);
  return out;
}

class Sink {
 public:
  static Sink& Get() {
    static Sink sink;
    return sink;
  }

  // The step this call belongs to, or -1 where it is not recorded (every `every`-th step is, from the first).
  int32_t Step(int64_t module, int64_t site, int32_t device, int64_t every, int64_t calls) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto key = std::make_tuple(module, site, device);
    const int64_t step = counts_[key]++ / (calls > 0 ? calls : 1);
    const int32_t out = every > 0 && step % every == 0 ? static_cast<int32_t>(step) : -1;
    last_[key] = out;
    return out;
  }

  // The latest decision of Step for a GEMM on a device (what its record call belongs to), -1 before any.
  int32_t LastStep(int64_t module, int64_t site, int32_t device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = last_.find(std::make_tuple(module, site, device));
    return it == last_.end() ? -1 : it->second;
  }

  // Keeps the records of one device per GEMM (the first that records it): the statistics are of the whole tensor,
  // the same on every device.
  void Add(Record record) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [owner, unused] = owners_.emplace(std::make_pair(record.module, record.site), record.device);
    if (owner->second == record.device) records_.push_back(std::move(record));
  }

  // One device's part of a partitioned GEMM's statistics (its shards' rows: a replica's are zeros), `parts` devices
  // in all, all in this process. Once the last part is in, the parts are added in device order (AddRows: the same
  // sums whatever order the devices ran in) and the GEMM's record is added, and returned for the strict-mode check;
  // before, nullopt.
  std::optional<Record> AddPart(const Record& part, int64_t parts) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto key = std::make_tuple(part.module, part.site, part.step, part.block);
    std::vector<Record>& in = parts_[key];
    in.push_back(part);
    if (static_cast<int64_t>(in.size()) < parts) return std::nullopt;
    std::sort(in.begin(), in.end(), [](const Record& a, const Record& b) { return a.device < b.device; });
    Record whole = in[0];
    const int64_t rows = static_cast<int64_t>(whole.values.size()) / kNumFields;
    for (size_t d = 1; d < in.size(); ++d) AddRows(whole.values.data(), in[d].values.data(), rows);
    parts_.erase(key);
    records_.push_back(whole);
    return whole;
  }

  // A GEMM's record, or with `parts` > 1 one device's part of it (AddPart) -> the whole record where it is complete
  // (what the strict-mode check reads), else nullopt.
  std::optional<Record> Put(Record record, int64_t parts) {
    if (parts > 1) return AddPart(record, parts);
    Add(record);
    return record;
  }

  std::vector<Record> Drain() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Record> out;
    out.swap(records_);
    return out;
  }

  // What a strict-mode error names: the GEMM's layer and role (set by the pass when it emits the call).
  void SetLabel(int64_t module, int64_t site, std::string label) {
    std::lock_guard<std::mutex> lock(mu_);
    labels_[std::make_pair(module, site)] = std::move(label);
  }
  std::string Label(int64_t module, int64_t site) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = labels_.find(std::make_pair(module, site));
    return it == labels_.end() ? "GEMM " + std::to_string(site) + " of module " + std::to_string(module) : it->second;
  }

 private:
  std::mutex mu_;
  std::map<std::tuple<int64_t, int64_t, int32_t>, int64_t> counts_;
  std::map<std::tuple<int64_t, int64_t, int32_t>, int32_t> last_;
  std::map<std::pair<int64_t, int64_t>, int32_t> owners_;
  std::map<std::tuple<int64_t, int64_t, int32_t, int32_t>, std::vector<Record>> parts_;  // AddPart's parts so far
  std::map<std::pair<int64_t, int64_t>, std::string> labels_;
  std::vector<Record> records_;
};

// The strict-mode check of one record: the message when operand row `row` has nonzero elements and none survives
// quantization, else "".
inline std::string AllZeroMessage(const Record& r, int64_t row) {
  if (row < 0) return "";
  const float* v = r.values.data() + row * kNumFields;
  if (v[kNonzero] == 0 || v[kQuantizedNonzero] != 0) return "";
  return "xla_fp4: the gradient operand of " + Sink::Get().Label(r.module, r.site) + " quantized to all zeros at step " +
         std::to_string(r.step) + " (" + std::to_string(static_cast<int64_t>(v[kNonzero])) +
         " nonzero elements, amax " + std::to_string(v[kAmax]) +
         "): this step would train on a zero gradient. XLA_FP4_STRICT=1 makes this an error; unset it to only warn, "
         "or keep this layer in high precision (XLA_FP4_EXCLUDE).";
}

}  // namespace xla_fp4::telemetry

#endif  // XLA_FP4_TELEMETRY_SINK_H_
