// Calls an XLA FFI handler (XLA_FFI_Handler*, e.g. XlaFp4QdqCpu) without XLA: a minimal XLA_FFI_Api (errors, and a
// thread pool that runs each scheduled task on its own std::thread) and a call frame builder for buffers and
// scalar attributes. Only what the CPU kernels use; any other API entry is null.
#ifndef XLA_FP4_TESTS_FAKE_FFI_H_
#define XLA_FP4_TESTS_FAKE_FFI_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/c_api.h"

// The C API leaves XLA_FFI_Error opaque; the fake runtime owns its definition.
struct XLA_FFI_Error {
  XLA_FFI_Error_Code code;
  std::string message;
};

namespace xla_fp4::testing {

// The execution context: the thread pool size reported to handlers and the threads started for their tasks.
struct FakeContext {
  int64_t num_threads = 1;
  std::mutex mu;
  std::vector<std::thread> threads;
  void JoinAll() {
    std::lock_guard<std::mutex> lock(mu);
    for (std::thread& t : threads) t.join();
    threads.clear();
  }
};

inline FakeContext* ContextOf(XLA_FFI_ExecutionContext* ctx) { return reinterpret_cast<FakeContext*>(ctx); }

inline XLA_FFI_Error* FakeErrorCreate(XLA_FFI_Error_Create_Args* args) {
  return new XLA_FFI_Error{args->errc, args->message != nullptr ? args->message : ""};
}
inline void FakeErrorGetMessage(XLA_FFI_Error_GetMessage_Args* args) { args->message = args->error->message.c_str(); }
inline void FakeErrorDestroy(XLA_FFI_Error_Destroy_Args* args) { delete args->error; }

inline XLA_FFI_Error* FakeThreadPoolSchedule(XLA_FFI_ThreadPool_Schedule_Args* args) {
  FakeContext* c = ContextOf(args->ctx);
  std::lock_guard<std::mutex> lock(c->mu);
  c->threads.emplace_back([task = args->task, data = args->data] { task(data); });
  return nullptr;
}
inline XLA_FFI_Error* FakeThreadPoolNumThreads(XLA_FFI_ThreadPool_NumThreads_Args* args) {
  *args->num_threads = ContextOf(args->ctx)->num_threads;
  return nullptr;
}

inline const XLA_FFI_Api* FakeApi() {
  static const XLA_FFI_Api api = [] {
    XLA_FFI_Api a{};
    a.struct_size = XLA_FFI_Api_STRUCT_SIZE;
    a.api_version = {XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
    a.XLA_FFI_Error_Create = FakeErrorCreate;
    a.XLA_FFI_Error_GetMessage = FakeErrorGetMessage;
    a.XLA_FFI_Error_Destroy = FakeErrorDestroy;
    a.XLA_FFI_ThreadPool_Schedule = FakeThreadPoolSchedule;
    a.XLA_FFI_ThreadPool_NumThreads = FakeThreadPoolNumThreads;
    return a;
  }();
  return &api;
}

// The outcome of a call: ok, or the handler's error code and message.
struct CallResult {
  bool ok = true;
  XLA_FFI_Error_Code code = XLA_FFI_Error_Code_OK;
  std::string message;
};

// Builds one call: arguments and results (caller-owned memory), attributes (sorted by name at Call time).
class CallFrameBuilder {
 public:
  CallFrameBuilder& Arg(XLA_FFI_DataType dtype, const void* data, std::vector<int64_t> dims) {
    args_.push_back(MakeBuffer(dtype, const_cast<void*>(data), std::move(dims)));
    return *this;
  }
  CallFrameBuilder& Ret(XLA_FFI_DataType dtype, void* data, std::vector<int64_t> dims) {
    rets_.push_back(MakeBuffer(dtype, data, std::move(dims)));
    return *this;
  }
  CallFrameBuilder& Attr(const std::string& name, int64_t v) { return Scalar(name, XLA_FFI_DataType_S64, &v, sizeof v); }
  CallFrameBuilder& Attr(const std::string& name, bool v) { return Scalar(name, XLA_FFI_DataType_PRED, &v, sizeof v); }

  CallResult Call(XLA_FFI_Handler* handler, int64_t num_threads = 1) {
    FakeContext context;
    context.num_threads = num_threads;
    std::vector<XLA_FFI_ArgType> arg_types(args_.size(), XLA_FFI_ArgType_BUFFER);
    std::vector<XLA_FFI_RetType> ret_types(rets_.size(), XLA_FFI_RetType_BUFFER);
    std::vector<void*> arg_ptrs, ret_ptrs;
    for (auto& b : args_) arg_ptrs.push_back(&b->buffer);
    for (auto& b : rets_) ret_ptrs.push_back(&b->buffer);
    std::vector<AttrStorage*> sorted;
    for (auto& a : attrs_) sorted.push_back(a.get());
    std::sort(sorted.begin(), sorted.end(), [](auto* x, auto* y) { return x->name < y->name; });
    std::vector<XLA_FFI_AttrType> attr_types(sorted.size(), XLA_FFI_AttrType_SCALAR);
    std::vector<XLA_FFI_ByteSpan*> attr_names;
    std::vector<void*> attr_ptrs;
    for (AttrStorage* a : sorted) {
      attr_names.push_back(&a->span);
      attr_ptrs.push_back(&a->scalar);
    }

    XLA_FFI_CallFrame frame{};
    frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
    frame.api = FakeApi();
    frame.ctx = reinterpret_cast<XLA_FFI_ExecutionContext*>(&context);
    frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
    frame.args = {XLA_FFI_Args_STRUCT_SIZE, nullptr, static_cast<int64_t>(args_.size()), arg_types.data(),
                  arg_ptrs.data()};
    frame.rets = {XLA_FFI_Rets_STRUCT_SIZE, nullptr, static_cast<int64_t>(rets_.size()), ret_types.data(),
                  ret_ptrs.data()};
    frame.attrs = {XLA_FFI_Attrs_STRUCT_SIZE, nullptr, static_cast<int64_t>(sorted.size()), attr_types.data(),
                   attr_names.data(), attr_ptrs.data()};
    XLA_FFI_Error* error = handler(&frame);
    context.JoinAll();
    CallResult result;
    if (error != nullptr) {
      result = {false, error->code, error->message};
      delete error;
    }
    return result;
  }

 private:
  struct BufferStorage {
    std::vector<int64_t> dims;
    XLA_FFI_Buffer buffer;
  };
  struct AttrStorage {
    std::string name;
    XLA_FFI_ByteSpan span;
    alignas(8) unsigned char value[8];
    XLA_FFI_Scalar scalar;
  };

  static std::unique_ptr<BufferStorage> MakeBuffer(XLA_FFI_DataType dtype, void* data, std::vector<int64_t> dims) {
    auto b = std::make_unique<BufferStorage>();
    b->dims = std::move(dims);
    b->buffer = {XLA_FFI_Buffer_STRUCT_SIZE, nullptr, dtype, data, static_cast<int64_t>(b->dims.size()),
                 b->dims.data()};
    return b;
  }
  CallFrameBuilder& Scalar(const std::string& name, XLA_FFI_DataType dtype, const void* v, size_t size) {
    auto a = std::make_unique<AttrStorage>();
    a->name = name;
    a->span = {a->name.data(), a->name.size()};
    std::memcpy(a->value, v, size);
    a->scalar = {dtype, a->value};
    attrs_.push_back(std::move(a));
    return *this;
  }

  std::vector<std::unique_ptr<BufferStorage>> args_, rets_;
  std::vector<std::unique_ptr<AttrStorage>> attrs_;
};

}  // namespace xla_fp4::testing

#endif  // XLA_FP4_TESTS_FAKE_FFI_H_
