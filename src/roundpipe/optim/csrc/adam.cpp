// Fused CPU Adam / AdamW step for roundpipe.optim.Adam.
//
// One pass over memory per parameter tensor: it reads the gradient (fp32, bf16 or fp16), the fp32
// master weight and the moments, and writes the master weight, the moments and, optionally, a
// low-precision "shadow" copy of the weight (the model copy that devices upload). The arithmetic
// follows torch.optim.Adam's single-tensor path operation by operation, so results agree with
// torch to rounding.
//
// Tensors arrive as a table of raw addresses (validated on the Python side) through the plain
// CPython API: without ATen or pybind11 headers this file compiles in a few seconds. The GIL is
// released for the whole step.

// Python.h first, as the C API requires.
#include <Python.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Dtype codes shared with roundpipe/optim/adam.py (_DTYPE_CODES).
enum DType : int { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

// Elements per work item: large enough to amortize dispatch, small enough to balance threads.
constexpr int64_t kChunk = 1 << 15;
// Elements per tile: a chunk is processed tile by tile so the low-precision conversions run as
// separate simple loops (which gcc vectorizes) over data still in L1, not as extra memory passes.
constexpr int64_t kTile = 1024;

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits.
void widen_bf16(const uint16_t* __restrict__ in, float* __restrict__ out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(in[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    out[i] = f;
  }
}

// fp32 -> bf16, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion, bit for bit.
void narrow_bf16(const float* __restrict__ in, uint16_t* __restrict__ out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &in[i], sizeof(u));
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[i] = static_cast<uint16_t>(in[i] != in[i] ? 0x7FC0u : rounded);
  }
}

// IEEE half <-> fp32 (round to nearest even), with F16C when the CPU has it.
void widen_f16(const uint16_t* __restrict__ in, float* __restrict__ out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) {
    _Float16 h;
    std::memcpy(&h, &in[i], sizeof(h));
    out[i] = static_cast<float>(h);
  }
}

void narrow_f16(const float* __restrict__ in, uint16_t* __restrict__ out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
#endif
  for (; i < n; ++i) {
    const _Float16 h = static_cast<_Float16>(in[i]);
    std::memcpy(&out[i], &h, sizeof(h));
  }
}

void copy_f32(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

// Hyperparameters shared by a whole parameter group, as float (torch's opmath type on CPU).
struct GroupScalars {
  float grad_sign;     // -1 when maximizing
  float weight_decay;  // coupled (L2) weight decay; 0 when decoupled
  float decay;         // decoupled weight decay factor 1 - lr * wd; 1 otherwise
  bool lerp_small;     // torch's lerp: weight < 0.5 -> m + w * (g - m), else g + (w - 1) * (g - m)
  float lerp_weight;   // w = 1 - beta1, or w - 1 when !lerp_small
  float beta2;
  float one_minus_beta2;
  float eps;
};

// Per-tensor description of one update.
struct TensorTask {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr unless amsgrad
  void* shadow;           // nullptr when there is no low-precision copy
  float neg_step_size;    // -lr / (1 - beta1^t)
  float bias_correction2_sqrt;
};

// The fp32 update of n elements. Scalars come in by value: read through a pointer inside the
// loop they could alias the stored floats, and gcc would refuse to vectorize.
template <bool AMSGRAD, bool COUPLED_WD>
void adam_tile(const float* __restrict__ grad, float* __restrict__ param,
               float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
               float* __restrict__ max_sq, int64_t n, const GroupScalars s, const float neg_step,
               const float bc2_sqrt) {
  const float grad_sign = s.grad_sign, weight_decay = s.weight_decay, decay = s.decay;
  const bool lerp_small = s.lerp_small;
  const float lerp_weight = s.lerp_weight, beta2 = s.beta2, one_minus_beta2 = s.one_minus_beta2;
  const float eps = s.eps;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    // Rounding mirrors torch's vectorized CPU kernels: add(alpha), lerp and addcmul use one
    // fused multiply-add each, the rest round every operation (built with -ffp-contract=off).
    float g = grad[i] * grad_sign;
    float p = param[i];
    if constexpr (COUPLED_WD) g = std::fma(p, weight_decay, g);  // grad.add(param, alpha=wd)
    p = p * decay;
    // exp_avg.lerp_(g, 1 - beta1), in torch's two forms for small and large weights
    float m = exp_avg[i];
    const float diff = g - m;
    m = lerp_small ? std::fma(lerp_weight, diff, m) : std::fma(lerp_weight, diff, g);
    // exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    const float v = std::fma(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2);
    float vs = v;
    if constexpr (AMSGRAD) {
      vs = std::max(max_sq[i], v);
      max_sq[i] = vs;
    }
    // denom = sqrt(v) / sqrt(1 - beta2^t) + eps; param.addcdiv_(exp_avg, denom, -step_size)
    const float denom = std::sqrt(vs) / bc2_sqrt + eps;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p + neg_step * m / denom;
  }
}

template <int GRAD, int SHADOW, bool AMSGRAD, bool COUPLED_WD>
void adam_chunk(const TensorTask& t, const GroupScalars& s, int64_t begin, int64_t end) {
  alignas(64) float grad_tile[kTile];
  for (int64_t b = begin; b < end; b += kTile) {
    const int64_t n = std::min(kTile, end - b);
    const float* grad;
    if constexpr (GRAD == kF32) {
      grad = static_cast<const float*>(t.grad) + b;
    } else {
      const uint16_t* low = static_cast<const uint16_t*>(t.grad) + b;
      if constexpr (GRAD == kBF16) widen_bf16(low, grad_tile, n);
      if constexpr (GRAD == kF16) widen_f16(low, grad_tile, n);
      grad = grad_tile;
    }
    float* max_sq = AMSGRAD ? t.max_exp_avg_sq + b : nullptr;
    adam_tile<AMSGRAD, COUPLED_WD>(grad, t.param + b, t.exp_avg + b, t.exp_avg_sq + b, max_sq, n,
                                   s, t.neg_step_size, t.bias_correction2_sqrt);
    // The shadow is written from the tile just stored, which is still in L1.
    if constexpr (SHADOW == kF32) copy_f32(t.param + b, static_cast<float*>(t.shadow) + b, n);
    if constexpr (SHADOW == kBF16) narrow_bf16(t.param + b, static_cast<uint16_t*>(t.shadow) + b, n);
    if constexpr (SHADOW == kF16) narrow_f16(t.param + b, static_cast<uint16_t*>(t.shadow) + b, n);
  }
}

using ChunkFn = void (*)(const TensorTask&, const GroupScalars&, int64_t, int64_t);

template <int GRAD, int SHADOW>
ChunkFn pick_flags(bool amsgrad, bool coupled) {
  if (amsgrad) {
    return coupled ? adam_chunk<GRAD, SHADOW, true, true> : adam_chunk<GRAD, SHADOW, true, false>;
  }
  return coupled ? adam_chunk<GRAD, SHADOW, false, true> : adam_chunk<GRAD, SHADOW, false, false>;
}

template <int GRAD>
ChunkFn pick_shadow(int shadow, bool amsgrad, bool coupled) {
  switch (shadow) {
    case kNone: return pick_flags<GRAD, kNone>(amsgrad, coupled);
    case kF32: return pick_flags<GRAD, kF32>(amsgrad, coupled);
    case kBF16: return pick_flags<GRAD, kBF16>(amsgrad, coupled);
    case kF16: return pick_flags<GRAD, kF16>(amsgrad, coupled);
    default: return nullptr;
  }
}

ChunkFn pick_kernel(int grad, int shadow, bool amsgrad, bool coupled) {
  switch (grad) {
    case kF32: return pick_shadow<kF32>(shadow, amsgrad, coupled);
    case kBF16: return pick_shadow<kBF16>(shadow, amsgrad, coupled);
    case kF16: return pick_shadow<kF16>(shadow, amsgrad, coupled);
    default: return nullptr;
  }
}

template <typename T>
T* as_ptr(int64_t address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

// Layout of one row of the int64 task table built by roundpipe/optim/adam.py (_pack_tasks).
enum Column : int {
  kParam, kGrad, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kShadow, kNumel, kGradDtype, kShadowDtype,
  kColumns
};

struct Chunk {
  int32_t task;
  int64_t begin;
  int64_t end;
};

// Validates the task table and cuts it into chunks. Returns an error message, or nullptr.
const char* plan(const int64_t* table, const double* steps, int64_t n, bool amsgrad, bool coupled,
                 std::vector<TensorTask>& tasks, std::vector<ChunkFn>& fns,
                 std::vector<Chunk>& chunks) {
  tasks.resize(n);
  fns.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* row = table + i * kColumns;
    if (row[kNumel] < 0) return "adam: negative element count";
    // A zero-element tensor may have no storage (address 0, as torch reports it): nothing is
    // read or written for it (it gets no chunk), so only non-empty tensors need addresses.
    const bool empty = row[kNumel] == 0;
    if (!empty &&
        (row[kParam] == 0 || row[kGrad] == 0 || row[kExpAvg] == 0 || row[kExpAvgSq] == 0)) {
      return "adam: null tensor address";
    }
    if (!empty && amsgrad && row[kMaxExpAvgSq] == 0) return "adam: amsgrad needs max_exp_avg_sq";
    if (!empty && (row[kShadow] == 0) != (row[kShadowDtype] == kNone)) {
      return "adam: shadow address and dtype disagree";
    }
    fns[i] = pick_kernel(static_cast<int>(row[kGradDtype]), static_cast<int>(row[kShadowDtype]),
                         amsgrad, coupled);
    if (fns[i] == nullptr) return "adam: unsupported gradient or shadow dtype code";
    tasks[i] = TensorTask{as_ptr<float>(row[kParam]),
                          as_ptr<const void>(row[kGrad]),
                          as_ptr<float>(row[kExpAvg]),
                          as_ptr<float>(row[kExpAvgSq]),
                          amsgrad ? as_ptr<float>(row[kMaxExpAvgSq]) : nullptr,
                          as_ptr<void>(row[kShadow]),
                          static_cast<float>(-steps[2 * i]),
                          static_cast<float>(steps[2 * i + 1])};
    for (int64_t b = 0; b < row[kNumel]; b += kChunk) {
      chunks.push_back({static_cast<int32_t>(i), b, std::min(row[kNumel], b + kChunk)});
    }
  }
  return nullptr;
}

// adam(table, steps, n, beta1, beta2, weight_decay, decay, eps, amsgrad, maximize,
//      decoupled_weight_decay, num_threads) -> None
//
// One Adam step over n tensors sharing a parameter group's hyperparameters. `table` is the
// address of a contiguous int64 [n, kColumns] array (tensor addresses, element counts, dtype
// codes; tensors are contiguous fp32 storage, complex ones passed as their real views); `steps`
// the address of a float64 [n, 2] array of (step_size, sqrt(1 - beta2^t)) per tensor. `decay` is
// the decoupled weight decay factor 1 - lr * weight_decay (computed by the caller, in fp32 when
// lr is a tensor, as torch does). The GIL is released while the step runs.
PyObject* adam(PyObject* /*self*/, PyObject* args) {
  long long table_addr, steps_addr, n;
  double beta1, beta2, weight_decay, decay, eps;
  int amsgrad, maximize, decoupled, num_threads;
  if (!PyArg_ParseTuple(args, "LLLdddddpppi", &table_addr, &steps_addr, &n, &beta1, &beta2,
                        &weight_decay, &decay, &eps, &amsgrad, &maximize, &decoupled,
                        &num_threads)) {
    return nullptr;
  }
  if (n < 0 || (n > 0 && (table_addr == 0 || steps_addr == 0))) {
    PyErr_SetString(PyExc_ValueError, "adam: bad task table");
    return nullptr;
  }

  // Scalars are rounded to float exactly where torch's CPU kernels round them.
  GroupScalars s;
  s.grad_sign = maximize ? -1.0f : 1.0f;
  const bool coupled = weight_decay != 0.0 && !decoupled;
  s.weight_decay = coupled ? static_cast<float>(weight_decay) : 0.0f;
  s.decay = (weight_decay != 0.0 && decoupled) ? static_cast<float>(decay) : 1.0f;
  const float weight = static_cast<float>(1.0 - beta1);
  s.lerp_small = std::abs(weight) < 0.5f;
  s.lerp_weight = s.lerp_small ? weight : weight - 1.0f;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);

  std::vector<TensorTask> tasks;
  std::vector<ChunkFn> fns;
  std::vector<Chunk> chunks;
  const char* error = plan(as_ptr<const int64_t>(table_addr), as_ptr<const double>(steps_addr),
                           n, amsgrad != 0, coupled, tasks, fns, chunks);
  if (error != nullptr) {
    PyErr_SetString(PyExc_ValueError, error);
    return nullptr;
  }

  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, n_chunks)));
  // Release the GIL for the whole step so Python threads (the training loop) keep running.
  Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < n_chunks; ++c) {
    const Chunk& ch = chunks[c];
    fns[ch.task](tasks[ch.task], s, ch.begin, ch.end);
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"adam", adam, METH_VARARGS, "One fused Adam/AdamW step over a table of tensors."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, nullptr,
                          "Fused CPU Adam step for roundpipe.optim.Adam", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

#define ROUNDPIPE_CONCAT_(a, b) a##b
#define ROUNDPIPE_CONCAT(a, b) ROUNDPIPE_CONCAT_(a, b)
#define ROUNDPIPE_STR_(a) #a
#define ROUNDPIPE_STR(a) ROUNDPIPE_STR_(a)

// torch.utils.cpp_extension.load names the module through TORCH_EXTENSION_NAME.
PyMODINIT_FUNC ROUNDPIPE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  module_def.m_name = ROUNDPIPE_STR(TORCH_EXTENSION_NAME);
  return PyModule_Create(&module_def);
}
