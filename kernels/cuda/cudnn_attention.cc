#include "kernels/cuda/cudnn_attention.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#if !defined(COLOD_CUDA_EMULATION)
#include <cudnn.h>
#include <dlfcn.h>

#include <array>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/status.h"
#endif

namespace colod::kernels::cuda {
namespace {

std::atomic<int64_t> served_calls{0};

}  // namespace

bool CudnnAttentionRequested() {
  const char* v = std::getenv("COLOD_ATTENTION");
  return v != nullptr && absl::string_view(v) == "cudnn";
}

absl::Status CudnnAttentionServes(const CudnnAttentionShape& shape, const AttentionBias& extra) {
  auto refuse = [](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("cuDNN attention: ", why));
  };
  if (extra.alibi != nullptr || extra.bias != nullptr || extra.dbias != nullptr) {
    return refuse("ALiBi and additive score biases run on colod's kernels");
  }
  if (shape.type != ElemType::kBF16 && shape.type != ElemType::kF16) return refuse("bf16 or f16 operands only");
  if (shape.d < 8 || shape.d > 128 || shape.d % 8 != 0) {
    return refuse(absl::StrCat("head dim ", shape.d, ": a multiple of 8 up to 128 only"));
  }
  if (shape.b < 1 || shape.s < 1 || shape.hkv < 1 || shape.hq < shape.hkv || shape.hq % shape.hkv != 0) {
    return refuse(absl::StrCat("b ", shape.b, ", s ", shape.s, ", hq ", shape.hq, ", hkv ", shape.hkv,
                               ": every size positive and hq a multiple of hkv"));
  }
  for (const HeadRows& r : {shape.layout.q, shape.layout.kv, shape.layout.dq, shape.layout.dkv}) {
    if (r.token < 1 || r.head < 1 || r.token % 8 != 0 || r.head % 8 != 0) {
      return refuse(absl::StrCat("strides {", r.token, ", ", r.head, "}: whole multiples of 16 bytes only"));
    }
  }
  // The largest buffer the backward asks for, b s hq d f32 (dQ's
  // accumulator), and each operand's extent within int64.
  int64_t n = 0;
  if (__builtin_mul_overflow(shape.b, shape.s, &n) || __builtin_mul_overflow(n, shape.hq, &n) ||
      __builtin_mul_overflow(n, shape.d, &n) || __builtin_mul_overflow(n, int64_t{4}, &n)) {
    return refuse("the operands' size overflows");
  }
  for (const HeadRows& r : {shape.layout.q, shape.layout.kv, shape.layout.dq, shape.layout.dkv}) {
    if (__builtin_mul_overflow(shape.b * shape.s, r.token, &n)) return refuse("an operand's extent overflows");
  }
  // The graphs' [b, hq, s, s] score views (never in memory) have strides up to hq s s.
  if (__builtin_mul_overflow(shape.s, shape.s, &n) || __builtin_mul_overflow(n, shape.hq, &n) ||
      __builtin_mul_overflow(n, shape.b, &n)) {
    return refuse("the scores' extent overflows");
  }
  return absl::OkStatus();
}

int64_t CudnnAttentionCalls() { return served_calls.load(std::memory_order_relaxed); }

std::string CudnnH100DeviceJson() {
  // The fields cuDNN 9's CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION reads,
  // with an H100 SXM's values (cudaDeviceProp's, deviceVer 10 major + minor).
  return R"({"deviceName": "NVIDIA H100 80GB HBM3", "deviceVer": 900, "driverVer": 13000, "cudaDeviceId": 0,)"
         R"( "multiProcessorCount": 132, "maxGridSize": [2147483647, 65535, 65535], "maxBlockSize": [1024, 1024, 64],)"
         R"( "regsPerBlock": 65536, "warpSize": 32, "maxSharedMemoryPerBlock": 49152,)"
         R"( "maxSharedMemoryPerBlockOptin": 232448, "reservedSharedMemoryPerBlock": 1024, "maxRegistersPerSM": 65536,)"
         R"( "maxCtasPerSM": 32, "maxThreadsPerBlock": 1024, "maxThreadsPerSM": 2048, "pciDeviceId": 0,)"
         R"( "isTccDriver": 0, "supportCoopLaunch": 1, "totalGlobalMem": 85017755648, "smClockRateKHz": 1980000,)"
         R"( "memClockRateKHz": 2619000, "l2CacheSize": 52428800})";
}

#if defined(COLOD_CUDA_EMULATION)

// The emulation models CUDA's runtime, cuBLAS and NCCL, not cuDNN.
absl::Status CudnnAttentionForward(int, CUstream_st*, const CudnnAttentionShape&, const void*, const void*, const void*,
                                   void*, float*, float) {
  return absl::UnavailableError("cuDNN attention: not part of the CUDA emulation");
}

absl::Status CudnnAttentionBackward(int, CUstream_st*, const CudnnAttentionShape&, const void*, const void*,
                                    const void*, const void*, const void*, const float*, void*, void*, void*, float) {
  return absl::UnavailableError("cuDNN attention: not part of the CUDA emulation");
}

absl::StatusOr<CudnnDevicelessPlan> CudnnAttentionDeviceless(const std::string&, const CudnnAttentionShape&, bool) {
  return absl::FailedPreconditionError("cuDNN attention: not part of the CUDA emulation");
}

#else  // !COLOD_CUDA_EMULATION

namespace {

// The cuDNN entry points colod calls, from the library dlopen found.
struct Api {
  size_t version = 0;
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) CreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) SetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) GetAttribute = nullptr;
  decltype(&cudnnBackendFinalize) Finalize = nullptr;
  decltype(&cudnnBackendExecute) Execute = nullptr;
  decltype(&cudnnGetErrorString) ErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) LastErrorString = nullptr;
};

absl::StatusOr<const Api*> Load(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    return absl::FailedPreconditionError(absl::StrCat("cuDNN attention: cannot load ", path, ": ", e ? e : "?"));
  }
  auto api = std::make_unique<Api>();
  bool missing = false;
  std::string which;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (fn == nullptr && !missing) {  // the first one missing
      missing = true;
      which = name;
    }
  };
  sym(api->GetVersion, "cudnnGetVersion");
  sym(api->Create, "cudnnCreate");
  sym(api->SetStream, "cudnnSetStream");
  sym(api->CreateDescriptor, "cudnnBackendCreateDescriptor");
  sym(api->DestroyDescriptor, "cudnnBackendDestroyDescriptor");
  sym(api->SetAttribute, "cudnnBackendSetAttribute");
  sym(api->GetAttribute, "cudnnBackendGetAttribute");
  sym(api->Finalize, "cudnnBackendFinalize");
  sym(api->Execute, "cudnnBackendExecute");
  sym(api->ErrorString, "cudnnGetErrorString");
  sym(api->LastErrorString, "cudnnGetLastErrorString");
  if (missing) {
    dlclose(lib);
    return absl::FailedPreconditionError(absl::StrCat("cuDNN attention: ", path, " has no ", which));
  }
  api->version = api->GetVersion();
  if (api->version < 90000) {
    dlclose(lib);
    return absl::FailedPreconditionError(
        absl::StrCat("cuDNN attention: ", path, " is cuDNN ", api->version, "; it needs cuDNN 9"));
  }
  return api.release();  // kept for the process, as the library is
}

// The library COLOD_CUDNN_LIBRARY names (libcudnn.so.9 by default), loaded
// once per name.
absl::StatusOr<const Api*> LoadApi() {
  static absl::Mutex mu(absl::kConstInit);
  static auto* loaded = new std::map<std::string, absl::StatusOr<const Api*>>();
  const char* env = std::getenv("COLOD_CUDNN_LIBRARY");
  const std::string path = env != nullptr && *env != '\0' ? env : "libcudnn.so.9";
  absl::MutexLock lock(&mu);
  auto it = loaded->find(path);
  if (it == loaded->end()) it = loaded->emplace(path, Load(path)).first;
  return it->second;
}

std::string Describe(const Api& api, cudnnStatus_t st, absl::string_view what) {
  char last[1024] = {0};
  api.LastErrorString(last, sizeof last);
  return absl::StrCat(what, ": ", api.ErrorString(st), last[0] != '\0' ? absl::StrCat(" (", last, ")") : "");
}

// Every descriptor of one graph and its plan, destroyed together. The
// first refused call is kept; later calls do nothing.
class Graph {
 public:
  explicit Graph(const Api& api) : api_(api) {}
  ~Graph() {
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) api_.DestroyDescriptor(*it);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  const absl::Status& status() const { return status_; }
  const Api& api() const { return api_; }

  cudnnBackendDescriptor_t New(cudnnBackendDescriptorType_t type, absl::string_view what) {
    cudnnBackendDescriptor_t d = nullptr;
    if (!status_.ok()) return nullptr;
    Check(api_.CreateDescriptor(type, &d), what);
    if (d != nullptr) owned_.push_back(d);
    return d;
  }
  void Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           int64_t count, const void* values, absl::string_view what) {
    if (status_.ok()) Check(api_.SetAttribute(d, name, type, count, values), what);
  }
  void SetDesc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value,
               absl::string_view what) {
    Set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what);
  }
  void Finalize(cudnnBackendDescriptor_t d, absl::string_view what) {
    if (status_.ok()) Check(api_.Finalize(d), what);
  }
  void Check(cudnnStatus_t st, absl::string_view what) {
    if (st != CUDNN_STATUS_SUCCESS && status_.ok()) status_ = absl::InternalError(Describe(api_, st, what));
  }

  // A tensor: uid 0 makes a virtual one (numbered from 1000).
  cudnnBackendDescriptor_t Tensor(const std::vector<int64_t>& dims, const std::vector<int64_t>& strides,
                                  cudnnDataType_t type, int64_t uid, bool by_value = false) {
    cudnnBackendDescriptor_t t = New(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
    const bool is_virtual = uid == 0;
    if (is_virtual) uid = next_virtual_++;
    const int64_t alignment = 16;
    Set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor type");
    Set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, static_cast<int64_t>(dims.size()), dims.data(), "dims");
    Set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, static_cast<int64_t>(strides.size()), strides.data(),
        "strides");
    Set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "uid");
    Set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "alignment");
    Set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "virtual");
    if (by_value) Set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "by value");
    Finalize(t, "a tensor");
    return t;
  }
  // A host f32 scalar passed by value at execution.
  cudnnBackendDescriptor_t Scalar(int64_t uid) {
    return Tensor({1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, uid, /*by_value=*/true);
  }

  void Pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t precision = CUDNN_DATA_FLOAT,
                 int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = New(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
    Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &precision, "pointwise precision");
    if (axis >= 0) Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    Finalize(pw, "a pointwise descriptor");
    Operation(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw},
               {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x},
               {CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b},
               {CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t},
               {CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y}},
              "a pointwise op");
  }
  void Reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t r = New(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    Set(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction mode");
    Set(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "reduction type");
    Finalize(r, "a reduction descriptor");
    Operation(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x},
               {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y},
               {CUDNN_ATTR_OPERATION_REDUCTION_DESC, r}},
              "a reduction op");
  }
  void Matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    cudnnBackendDescriptor_t m = New(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    Set(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "matmul type");
    Finalize(m, "a matmul descriptor");
    Operation(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_MATMUL_ADESC, a},
               {CUDNN_ATTR_OPERATION_MATMUL_BDESC, b},
               {CUDNN_ATTR_OPERATION_MATMUL_CDESC, c},
               {CUDNN_ATTR_OPERATION_MATMUL_DESC, m}},
              "a matmul op");
  }
  void Reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Operation(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x}, {CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y}}, "a reshape op");
  }

  // The operation graph of every op so far (for `handle`'s device, or none
  // for a deviceless plan).
  cudnnBackendDescriptor_t OperationGraph(cudnnHandle_t handle) {
    cudnnBackendDescriptor_t g = New(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    Set(g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()), ops_.data(),
        "the graph's ops");
    if (handle != nullptr) Set(g, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "graph handle");
    Finalize(g, "the operation graph");
    return g;
  }

 private:
  // An operation of `type` whose descriptor attributes are `operands` (a
  // null one left out), finalized and added to the graph's ops.
  void Operation(cudnnBackendDescriptorType_t type,
                 std::initializer_list<std::pair<cudnnBackendAttributeName_t, cudnnBackendDescriptor_t>> operands,
                 absl::string_view what) {
    cudnnBackendDescriptor_t op = New(type, what);
    for (const auto& [name, operand] : operands) {
      if (operand != nullptr) SetDesc(op, name, operand, what);
    }
    Finalize(op, what);
    if (op != nullptr) ops_.push_back(op);
  }

  const Api& api_;
  absl::Status status_;
  std::vector<cudnnBackendDescriptor_t> owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = 1000;
};

// The graphs' non-virtual tensors.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kNegInf,
  kOne,
  kDo,
  kDq,
  kDk,
  kDv,
  kRowSums,  // the backward's rowsum(dO O), f32 scratch
  kDqAccum,  // the backward's f32 dQ accumulator (scratch), unless deterministic
};

cudnnDataType_t CudnnType(ElemType t) { return t == ElemType::kF16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16; }

// [b, heads, s, d] views of operands laid out as `rows` (HeadRows: row (b,
// i) of head h at token (b s + i) + head h), or their transposes [b, heads,
// d, s].
std::vector<int64_t> RowStrides(const CudnnAttentionShape& a, HeadRows rows) {
  return {a.s * rows.token, rows.head, rows.token, 1};
}
std::vector<int64_t> TransposedStrides(const CudnnAttentionShape& a, HeadRows rows) {
  return {a.s * rows.token, rows.head, 1, rows.token};
}

// The shapes the graphs of `a` use besides the operands': the [b, hq, s,
// s] scores (never in memory: virtual), their [b, hq, s_kv, s_q]
// transposes, the [b, hq, s, 1] row statistics, and [b, hq, s, d] heads
// each contiguous (the f32 accumulators and products).
struct Views {
  explicit Views(const CudnnAttentionShape& a)
      : scores{a.b, a.hq, a.s, a.s},
        score_strides{a.hq * a.s * a.s, a.s * a.s, a.s, 1},
        transposed_strides{a.hq * a.s * a.s, a.s * a.s, 1, a.s},
        rows{a.b, a.hq, a.s, 1},
        row_strides{a.hq * a.s, a.s, 1, 1},
        heads{a.b, a.hq, a.s, a.d},
        head_strides{a.hq * a.s * a.d, a.s * a.d, a.d, 1} {}
  std::vector<int64_t> scores, score_strides, transposed_strides, rows, row_strides, heads, head_strides;
};

// What both graphs read or write: Q, K^T, O ([b, s, hq, d] contiguous) and
// the row statistics lse.
struct Operands {
  cudnnBackendDescriptor_t q, kt, o, stats;
};
Operands CommonOperands(Graph& g, const CudnnAttentionShape& a, const Views& views) {
  const cudnnDataType_t io = CudnnType(a.type);
  return {g.Tensor(views.heads, RowStrides(a, a.layout.q), io, kQ),
          g.Tensor({a.b, a.hkv, a.d, a.s}, TransposedStrides(a, a.layout.kv), io, kK),
          g.Tensor(views.heads, RowStrides(a, ContiguousHeadRows(a.hq, a.d)), io, kO),
          g.Tensor(views.rows, views.row_strides, CUDNN_DATA_FLOAT, kStats)};
}

// S = Q K^T scale (minus lse in the backward: `stats_or_null`), masked
// (causal: key j > query i hidden by generated indices); f32, virtual.
cudnnBackendDescriptor_t Scores(Graph& g, const CudnnAttentionShape& a, const Views& views, const Operands& in,
                                cudnnBackendDescriptor_t scale, cudnnBackendDescriptor_t stats_or_null) {
  auto scores = [&](cudnnDataType_t type) { return g.Tensor(views.scores, views.score_strides, type, 0); };
  cudnnBackendDescriptor_t product = scores(CUDNN_DATA_FLOAT);
  g.Matmul(in.q, in.kt, product);
  cudnnBackendDescriptor_t out = scores(CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, product, scale, nullptr, out);
  if (stats_or_null != nullptr) {  // the backward: S - lse, before the mask (cuDNN's frontend's order)
    cudnnBackendDescriptor_t shifted = scores(CUDNN_DATA_FLOAT);
    g.Pointwise(CUDNN_POINTWISE_SUB, out, stats_or_null, nullptr, shifted);
    out = shifted;
  }
  if (a.causal) {
    cudnnBackendDescriptor_t row = scores(CUDNN_DATA_INT32);
    g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, out, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
    cudnnBackendDescriptor_t col = scores(CUDNN_DATA_INT32);
    g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, out, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
    cudnnBackendDescriptor_t keep = scores(CUDNN_DATA_BOOLEAN);
    g.Pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
    cudnnBackendDescriptor_t masked = scores(CUDNN_DATA_FLOAT);
    g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, out, g.Scalar(kNegInf), keep, masked);
    out = masked;
  }
  return out;
}

void BuildForward(Graph& g, const CudnnAttentionShape& a) {
  const cudnnDataType_t io = CudnnType(a.type);
  const Views views(a);
  const Operands in = CommonOperands(g, a, views);
  cudnnBackendDescriptor_t v = g.Tensor({a.b, a.hkv, a.s, a.d}, RowStrides(a, a.layout.kv), io, kV);
  cudnnBackendDescriptor_t s = Scores(g, a, views, in, g.Scalar(kScale), nullptr);
  auto scores = [&](cudnnDataType_t type) { return g.Tensor(views.scores, views.score_strides, type, 0); };
  auto rows = [&] { return g.Tensor(views.rows, views.row_strides, CUDNN_DATA_FLOAT, 0); };
  // The softmax and its statistics: max, exp(S - max), the sum, lse = max + log sum.
  cudnnBackendDescriptor_t mx = rows();
  g.Reduction(CUDNN_REDUCE_TENSOR_MAX, s, mx);
  cudnnBackendDescriptor_t centered = scores(CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_SUB, s, mx, nullptr, centered);
  cudnnBackendDescriptor_t e = scores(CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_EXP, centered, nullptr, nullptr, e);
  cudnnBackendDescriptor_t sum = rows();
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  cudnnBackendDescriptor_t log_sum = rows();
  g.Pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, nullptr, log_sum);
  g.Pointwise(CUDNN_POINTWISE_ADD, mx, log_sum, nullptr, in.stats);
  cudnnBackendDescriptor_t p = scores(io);
  g.Pointwise(CUDNN_POINTWISE_DIV, e, sum, nullptr, p);
  g.Matmul(p, v, in.o);
}

void BuildBackward(Graph& g, const CudnnAttentionShape& a) {
  const cudnnDataType_t io = CudnnType(a.type);
  const Views views(a);
  const Operands in = CommonOperands(g, a, views);
  cudnnBackendDescriptor_t vt = g.Tensor({a.b, a.hkv, a.d, a.s}, TransposedStrides(a, a.layout.kv), io, kV);
  cudnnBackendDescriptor_t dout = g.Tensor(views.heads, RowStrides(a, ContiguousHeadRows(a.hq, a.d)), io, kDo);
  cudnnBackendDescriptor_t scale = g.Scalar(kScale);
  auto scores = [&](cudnnDataType_t type) { return g.Tensor(views.scores, views.score_strides, type, 0); };
  auto transposed = [&] { return g.Tensor(views.scores, views.transposed_strides, io, 0); };  // [b, hq, s_kv, s_q]

  // delta = rowsum(dO * O), to scratch (kRowSums).
  cudnnBackendDescriptor_t prod =
      g.Tensor(views.heads, {a.hq * a.s * a.d, a.s * a.d, a.hq * a.d, 1}, CUDNN_DATA_FLOAT, 0);
  g.Pointwise(CUDNN_POINTWISE_MUL, dout, in.o, nullptr, prod);
  cudnnBackendDescriptor_t delta_sum = g.Tensor(views.rows, views.row_strides, CUDNN_DATA_FLOAT, 0);
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, prod, delta_sum);
  cudnnBackendDescriptor_t delta = g.Tensor(views.rows, views.row_strides, CUDNN_DATA_FLOAT, kRowSums);
  g.Pointwise(CUDNN_POINTWISE_MUL, delta_sum, g.Scalar(kOne), nullptr, delta);

  // P = exp(S - lse), recomputed.
  cudnnBackendDescriptor_t s = Scores(g, a, views, in, scale, in.stats);
  cudnnBackendDescriptor_t p = scores(CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_EXP, s, nullptr, nullptr, p);

  // dV = P^T dO (over the hq / hkv query heads of each kv head).
  auto into_kv_heads = [&](cudnnBackendDescriptor_t lhs, cudnnBackendDescriptor_t rhs, int64_t uid) {
    cudnnBackendDescriptor_t out = g.Tensor({a.b, a.hkv, a.s, a.d}, RowStrides(a, a.layout.dkv), io, uid);
    if (a.hq == a.hkv) {
      g.Matmul(lhs, rhs, out);
    } else {
      cudnnBackendDescriptor_t full = g.Tensor(views.heads, views.head_strides, io, 0);
      g.Matmul(lhs, rhs, full);
      g.Reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
    }
  };
  cudnnBackendDescriptor_t pt = transposed();
  g.Reshape(p, pt);
  into_kv_heads(pt, dout, kDv);

  // dS = P (dP - delta) scale, dP = dO V^T.
  cudnnBackendDescriptor_t dp = scores(CUDNN_DATA_FLOAT);
  g.Matmul(dout, vt, dp);
  cudnnBackendDescriptor_t dp_centered = scores(CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_SUB, dp, delta, nullptr, dp_centered);
  cudnnBackendDescriptor_t ds_unscaled = scores(CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, dp_centered, p, nullptr, ds_unscaled);
  cudnnBackendDescriptor_t ds = scores(CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, scale, nullptr, ds);

  // dK = dS^T Q.
  cudnnBackendDescriptor_t dst = transposed();
  g.Reshape(ds, dst);
  into_kv_heads(dst, in.q, kDk);

  // dQ = dS K: through an f32 accumulator, or straight (deterministic).
  cudnnBackendDescriptor_t k = g.Tensor({a.b, a.hkv, a.s, a.d}, RowStrides(a, a.layout.kv), CUDNN_DATA_FLOAT, 0);
  g.Reshape(in.kt, k);
  cudnnBackendDescriptor_t dq = g.Tensor(views.heads, RowStrides(a, a.layout.dq), io, kDq);
  if (a.deterministic) {
    g.Matmul(ds, k, dq);
  } else {
    cudnnBackendDescriptor_t acc = g.Tensor(views.heads, views.head_strides, CUDNN_DATA_FLOAT, kDqAccum);
    g.Matmul(ds, k, acc);
    g.Pointwise(CUDNN_POINTWISE_IDENTITY, acc, nullptr, nullptr, dq);
  }
}

// A graph's plan: its descriptors (kept alive with it) and what executing
// it needs.
struct Plan {
  std::unique_ptr<Graph> graph;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace = 0;
  std::string engine;
};

// The engine config's JSON, shortened for messages.
std::string EngineJson(Graph& g, cudnnBackendDescriptor_t plan) {
  std::string json(4096, '\0');
  int64_t n = 0;
  if (g.api().GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                           static_cast<int64_t>(json.size()), &n, json.data()) != CUDNN_STATUS_SUCCESS) {
    return "";
  }
  json.resize(std::min<size_t>(strnlen(json.data(), json.size()), 400));
  return json;
}

// The heuristics' engine configs (mode A) for graph `op_graph`, for the
// handle's device or `device_prop`'s.
std::vector<cudnnBackendDescriptor_t> Configs(Graph& g, cudnnBackendDescriptor_t op_graph,
                                              cudnnBackendDescriptor_t device_prop) {
  cudnnBackendDescriptor_t heur = g.New(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  g.SetDesc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, op_graph, "heuristics graph");
  g.Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
  if (device_prop != nullptr) g.SetDesc(heur, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, device_prop, "heuristics device");
  g.Finalize(heur, "the heuristics");
  int64_t count = 0;
  if (g.status().ok()) {
    g.Check(
        g.api().GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
        "the heuristics' count");
  }
  std::vector<cudnnBackendDescriptor_t> configs;
  for (int64_t i = 0; i < count && g.status().ok(); ++i) {
    configs.push_back(g.New(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
  }
  int64_t got = 0;
  if (g.status().ok() && count > 0) {
    g.Check(g.api().GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                 configs.data()),
            "the heuristics' configs");
  }
  configs.resize(g.status().ok() ? static_cast<size_t>(got) : 0);
  return configs;
}

std::string Direction(bool backward) { return backward ? "backward" : "forward"; }

// The graph of `a` and the first heuristics config's plan for `handle`'s
// device. UNAVAILABLE naming what cuDNN refused.
absl::StatusOr<std::shared_ptr<Plan>> BuildPlan(const Api& api, cudnnHandle_t handle, const CudnnAttentionShape& a,
                                                bool backward) {
  auto out = std::make_shared<Plan>();
  out->graph = std::make_unique<Graph>(api);
  Graph& g = *out->graph;
  if (backward) {
    BuildBackward(g, a);
  } else {
    BuildForward(g, a);
  }
  cudnnBackendDescriptor_t op_graph = g.OperationGraph(handle);
  std::vector<cudnnBackendDescriptor_t> configs = Configs(g, op_graph, nullptr);
  if (!g.status().ok()) return absl::UnavailableError(std::string(g.status().message()));
  std::string refusals;
  for (cudnnBackendDescriptor_t config : configs) {
    cudnnBackendDescriptor_t plan = g.New(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
    g.SetDesc(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config, "plan config");
    g.Set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "plan handle");
    if (!g.status().ok()) return absl::UnavailableError(std::string(g.status().message()));
    const cudnnStatus_t st = api.Finalize(plan);
    if (st != CUDNN_STATUS_SUCCESS) {
      absl::StrAppend(&refusals, refusals.empty() ? "" : "; ", Describe(api, st, "a config"));
      continue;
    }
    g.Check(
        api.GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, nullptr, &out->workspace),
        "the plan's workspace");
    if (!g.status().ok()) return absl::UnavailableError(std::string(g.status().message()));
    out->plan = plan;
    out->engine = EngineJson(g, plan);
    return out;
  }
  return absl::UnavailableError(absl::StrCat("cuDNN attention: no plan for the ", Direction(backward), " (",
                                             configs.size(), " configs",
                                             refusals.empty() ? "" : absl::StrCat(": ", refusals), ")"));
}

// A cuDNN handle per device (never destroyed, as the compute streams), and
// the lock its stream and executions are under.
struct Device {
  absl::Mutex mu;
  cudnnHandle_t handle ABSL_GUARDED_BY(mu) = nullptr;
};

class Plans {
 public:
  static Plans& Get() {
    static Plans* p = new Plans();
    return *p;
  }

  // The device's entry, its handle created on the first use (the caller's
  // current device is `device`: ComputeStream set it).
  absl::StatusOr<Device*> DeviceOf(const Api& api, int device) {
    Device* d = nullptr;
    {
      absl::MutexLock lock(&mu_);
      std::unique_ptr<Device>& slot = devices_[device];
      if (slot == nullptr) slot = std::make_unique<Device>();
      d = slot.get();
    }
    absl::MutexLock lock(&d->mu);
    if (d->handle == nullptr) {
      cudnnHandle_t h = nullptr;
      const cudnnStatus_t st = api.Create(&h);
      if (st != CUDNN_STATUS_SUCCESS) return absl::UnavailableError(Describe(api, st, "cuDNN attention: cudnnCreate"));
      d->handle = h;
    }
    return d;
  }

  // The plan of (device, shape, direction), built at the first call; a
  // shape cuDNN refused stays refused (its status is cached too).
  absl::StatusOr<std::shared_ptr<Plan>> Find(const Api& api, int device, Device& dev, const CudnnAttentionShape& a,
                                             bool backward) {
    const PlanKey key = {device,
                         backward,
                         static_cast<int64_t>(a.type),
                         a.b,
                         a.s,
                         a.hq,
                         a.hkv,
                         a.d,
                         a.causal,
                         a.deterministic,
                         a.layout.q.token,
                         a.layout.q.head,
                         a.layout.kv.token,
                         a.layout.kv.head,
                         a.layout.dq.token,
                         a.layout.dq.head,
                         a.layout.dkv.token,
                         a.layout.dkv.head};
    {
      absl::MutexLock lock(&mu_);
      auto it = plans_.find(key);
      if (it != plans_.end()) return it->second;
    }
    absl::StatusOr<std::shared_ptr<Plan>> built;
    {
      absl::MutexLock lock(&dev.mu);  // the handle builds one plan at a time
      built = BuildPlan(api, dev.handle, a, backward);
    }
    absl::MutexLock lock(&mu_);
    if (plans_.size() >= kMaxPlans) plans_.clear();  // shapes that come and go; the ones in use are held by callers
    return plans_.emplace(key, built).first->second;
  }

 private:
  static constexpr size_t kMaxPlans = 256;
  // Device, direction, type, b, s, hq, hkv, d, causal, deterministic and the
  // layout's eight strides: compared as numbers, not spelled as a string at
  // each call.
  using PlanKey = std::array<int64_t, 18>;
  absl::Mutex mu_;
  std::map<int, std::unique_ptr<Device>> devices_ ABSL_GUARDED_BY(mu_);
  std::map<PlanKey, absl::StatusOr<std::shared_ptr<Plan>>> plans_ ABSL_GUARDED_BY(mu_);
};

// Says once per reason (on stderr, the first 64 reasons) why the cuDNN
// path was not taken.
absl::Status Unavailable(const absl::Status& why) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* said = new std::set<std::string>();
  absl::Status out = absl::UnavailableError(why.message());
  absl::MutexLock lock(&mu);
  if (said->size() < 64 && said->insert(std::string(why.message())).second) {  // a bounded set of reasons
    std::fprintf(stderr, "colod: COLOD_ATTENTION=cudnn: %s; colod's attention kernels run instead\n",
                 std::string(why.message()).c_str());
  }
  return out;
}

// Runs `shape`'s plan in `direction` with the operands `ptrs` (by uid) and
// `scratch_bytes` of f32 scratch at the uids of `scratch` (each zeroed),
// after the plan's workspace.
absl::Status Run(int device, cudaStream_t stream, const CudnnAttentionShape& shape, bool backward,
                 std::vector<std::pair<int64_t, void*>> ptrs, const std::vector<std::pair<int64_t, int64_t>>& scratch) {
  absl::StatusOr<const Api*> api = LoadApi();
  if (!api.ok()) return Unavailable(api.status());
  absl::StatusOr<Device*> dev = Plans::Get().DeviceOf(**api, device);
  if (!dev.ok()) return Unavailable(dev.status());
  absl::StatusOr<std::shared_ptr<Plan>> plan = Plans::Get().Find(**api, device, **dev, shape, backward);
  if (!plan.ok()) return Unavailable(plan.status());
  const Plan& p = **plan;

  // One allocation: the workspace, then each scratch buffer, 256-aligned.
  auto round = [](int64_t n) { return (n + 255) / 256 * 256; };
  int64_t bytes = round(p.workspace);
  std::vector<int64_t> offsets;
  for (const auto& [uid, n] : scratch) {
    offsets.push_back(bytes);
    bytes += round(n);
  }
  void* base = nullptr;
  if (bytes > 0 && cudaMallocAsync(&base, static_cast<size_t>(bytes), stream) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: the failed allocation only
    // colod's kernels need less (the deterministic two need none).
    return Unavailable(absl::InternalError(absl::StrCat("cuDNN attention: no ", bytes, " bytes of scratch for the ",
                                                        Direction(backward), " on device ", device)));
  }
  auto run = [&]() -> absl::Status {
    for (size_t i = 0; i < scratch.size(); ++i) {
      void* at = static_cast<char*>(base) + offsets[i];
      COLOD_RETURN_IF_CUDA(cudaMemsetAsync(at, 0, static_cast<size_t>(scratch[i].second), stream));
      ptrs.emplace_back(scratch[i].first, at);
    }
    Graph pack_owner(**api);
    cudnnBackendDescriptor_t pack = pack_owner.New(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
    std::vector<int64_t> uids;
    std::vector<void*> data;
    for (const auto& [uid, ptr] : ptrs) {
      uids.push_back(uid);
      data.push_back(ptr);
    }
    void* workspace = p.workspace > 0 ? base : nullptr;
    pack_owner.Set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()),
                   uids.data(), "the pack's uids");
    pack_owner.Set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(data.size()),
                   data.data(), "the pack's pointers");
    pack_owner.Set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, "the workspace");
    pack_owner.Finalize(pack, "the variant pack");
    if (!pack_owner.status().ok()) return pack_owner.status();
    absl::MutexLock lock(&(*dev)->mu);
    const cudnnStatus_t set = (*api)->SetStream((*dev)->handle, stream);
    if (set != CUDNN_STATUS_SUCCESS)
      return absl::InternalError(Describe(**api, set, "cuDNN attention: cudnnSetStream"));
    const cudnnStatus_t ran = (*api)->Execute((*dev)->handle, p.plan, pack);
    if (ran != CUDNN_STATUS_SUCCESS) {
      return absl::InternalError(
          Describe(**api, ran, absl::StrCat("cuDNN attention: executing the ", Direction(backward), " plan")));
    }
    return absl::OkStatus();
  };
  const absl::Status st = run();
  if (base != nullptr) {
    const absl::Status freed = CudaStatus(cudaFreeAsync(base, stream), "cuDNN attention's scratch");
    if (st.ok() && !freed.ok()) return freed;
  }
  if (st.ok()) served_calls.fetch_add(1, std::memory_order_relaxed);
  return st;
}

}  // namespace

absl::Status CudnnAttentionForward(int device, CUstream_st* stream, const CudnnAttentionShape& shape, const void* q,
                                   const void* k, const void* v, void* out, float* lse, float scale) {
  float scale_value = scale, neg_inf = -INFINITY;
  std::vector<std::pair<int64_t, void*>> ptrs = {
      {kQ, const_cast<void*>(q)}, {kK, const_cast<void*>(k)}, {kV, const_cast<void*>(v)}, {kO, out}, {kStats, lse},
      {kScale, &scale_value}};
  if (shape.causal) ptrs.emplace_back(kNegInf, &neg_inf);  // the pack names the graph's tensors only
  return Run(device, stream, shape, /*backward=*/false, std::move(ptrs), {});
}

absl::Status CudnnAttentionBackward(int device, CUstream_st* stream, const CudnnAttentionShape& shape, const void* q,
                                    const void* k, const void* v, const void* out, const void* dout, const float* lse,
                                    void* dq, void* dk, void* dv, float scale) {
  float scale_value = scale, neg_inf = -INFINITY, one = 1.0f;
  const int64_t rows = shape.b * shape.hq * shape.s;  // CudnnAttentionServes checked rows d 4 fits
  std::vector<std::pair<int64_t, int64_t>> scratch = {{kRowSums, rows * 4}};
  if (!shape.deterministic) scratch.emplace_back(kDqAccum, rows * shape.d * 4);
  std::vector<std::pair<int64_t, void*>> ptrs = {{kQ, const_cast<void*>(q)},
                                                 {kK, const_cast<void*>(k)},
                                                 {kV, const_cast<void*>(v)},
                                                 {kO, const_cast<void*>(out)},
                                                 {kDo, const_cast<void*>(dout)},
                                                 {kStats, const_cast<float*>(lse)},
                                                 {kDq, dq},
                                                 {kDk, dk},
                                                 {kDv, dv},
                                                 {kScale, &scale_value},
                                                 {kOne, &one}};
  if (shape.causal) ptrs.emplace_back(kNegInf, &neg_inf);
  return Run(device, stream, shape, /*backward=*/true, std::move(ptrs), scratch);
}

absl::StatusOr<CudnnDevicelessPlan> CudnnAttentionDeviceless(const std::string& device_json,
                                                             const CudnnAttentionShape& shape, bool backward) {
  absl::StatusOr<const Api*> api = LoadApi();
  if (!api.ok()) return api.status();
  if ((*api)->version < 90800) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuDNN attention: cuDNN ", (*api)->version, " plans without a device from 9.8 on"));
  }
  Graph g(**api);
  cudnnBackendDescriptor_t prop = g.New(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, "device properties");
  g.Set(prop, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR, static_cast<int64_t>(device_json.size()),
        device_json.data(), "the device's JSON");
  g.Finalize(prop, "the device properties");
  if (backward) {
    BuildBackward(g, shape);
  } else {
    BuildForward(g, shape);
  }
  cudnnBackendDescriptor_t op_graph = g.OperationGraph(nullptr);
  CudnnDevicelessPlan out;
  if (g.status().ok()) {
    g.Check((*api)->GetAttribute(op_graph, CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT, CUDNN_TYPE_INT64, 1, nullptr,
                                 &out.engines),
            "the graph's engine count");
  }
  std::vector<cudnnBackendDescriptor_t> configs = Configs(g, op_graph, prop);
  if (!g.status().ok()) return g.status();
  out.configs = static_cast<int64_t>(configs.size());
  if (configs.empty()) return out;
  cudnnBackendDescriptor_t plan = g.New(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
  g.SetDesc(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, configs.front(), "plan config");
  g.SetDesc(plan, CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, prop, "plan device");
  if (!g.status().ok()) return g.status();
  const cudnnStatus_t st = (*api)->Finalize(plan);
  if (st == CUDNN_STATUS_SUCCESS) {
    out.compiled = true;
    out.engine = EngineJson(g, plan);
  } else if (const std::string why = Describe(**api, st, "loading the compiled kernel");
             st == CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER && absl::StrContains(why, "LoadData")) {
    // Compiled by NVRTC; loading it needs a driver (a stub answers here).
    out.compiled = true;
    out.engine = why;
  } else {
    return absl::InternalError(Describe(**api, st, "cuDNN attention: the first config's plan"));
  }
  return out;
}

#endif  // COLOD_CUDA_EMULATION

}  // namespace colod::kernels::cuda
