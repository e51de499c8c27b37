// CUDA kernels of the fused gate plus dispatch plan, and of the gate backward.
//
// Plan algorithm (the same as the CPU path in csrc/cpu/gate_cpu.cpp):
//   1. per chunk of 256 token rows: the gate weights (one thread per row, math from
//      replay_math.h) and the chunk's slot count per expert;
//   2. an exclusive scan of those counts over the chunks, per expert;
//   3. per chunk: each warp counts its 32 rows' slots per expert, a scan over the warps gives
//      each warp its first row per expert, and the warp scatters its slots 32 at a time,
//      ranking equal experts with __match_any_sync.
// Dense mode (gate_dense: probs != nullptr) adds to step 1 the row flags, the padding rule
// and the dense rows of probs and routing_map, written whole by the CTA of their chunk; with
// with_plan false, step 1 alone runs, in one launch.
// The model's own selection (csrc/include/replay_select.h, the CPU kernel's rule) runs in
// step 1, in the row's thread, for the flagged rows only (replay_mask False; with padding
// "select" a row with flags): `select_row` over the values a functor computes from the
// logits row, into the row's int32 experts, before its weights. With the agreement outputs
// every row is tested (`is_top_set`, or `select_row` + `same_set` with groups) and its set
// log-prob computed (`member_logsumexp`); the backward adds its gradient to the row it
// writes.
// Rows of an expert are in ascending flat-slot order (t*K + k), padding rows close each
// expert segment, and -1 fills padding and tail. Shared-memory integer atomics only build
// counts (whose values do not depend on the order of the additions); ranks never come from
// atomics, so the plan is bitwise deterministic. For T*K <= kSmallSlots all three steps run
// in one CTA, in one launch. Larger problems run the three steps as the phases of one
// cooperative launch (a persistent grid, at most as many CTAs as fit on the device at once,
// with a grid-wide barrier between phases), or, where the device cannot launch cooperative
// kernels, as three launches. Both run the same device functions and give the same bits.
#include <cooperative_groups.h>

#include "cuda_common.cuh"
#include "replay_select.h"

namespace replay_cuda {
namespace {

using namespace detail;
namespace rm = replay_math;

constexpr int kRowsPerCta = 256;  // chunk of token rows: one thread per row
// NOTE: one CTA writes ~1 MB of dense rows in a few microseconds; above that the rows are
// spread over the chunks' CTAs (the cooperative or three-launch path).
constexpr int64_t kSmallDenseElems = int64_t(1) << 18;
constexpr int kWarps = kRowsPerCta / 32;

// The softmax statistics of a row of E >= 1 logits, in id order: m = max_j x_j, s = sum_j
// exp(x_j - m). Computed at most once per row (`have`).
template <typename A>
struct RowStats {
  bool have = false;
  A m = A(0), s = A(0);
};

template <typename scalar_t>
__device__ __forceinline__ void row_stats(const scalar_t* x, int64_t E, RowStats<acc_t<scalar_t>>& st) {
  using A = acc_t<scalar_t>;
  if (st.have) return;
  A m = to_acc(x[0]);
  for (int64_t j = 1; j < E; ++j) m = rm::ro_max(m, to_acc(x[j]));
  A s = A(0);
  for (int64_t j = 0; j < E; ++j) s += rm::ro_exp(to_acc(x[j]) - m);
  st.m = m;
  st.s = s;
  st.have = true;
}

// The selection value of expert j of a row when it is the logit itself (replay_select.h
// ranks_logits): no score is computed.
template <typename scalar_t>
struct LogitValue {
  const scalar_t* x;
  __device__ __forceinline__ acc_t<scalar_t> operator()(int64_t j) const { return to_acc(x[j]); }
};

// The selection value v_j of a row (replay_select.h): the logit (source kSelectLogits) or
// its score (softmax: exp(x_j - m) / s with the row's statistics), rounded to the logits
// dtype when asked, plus the expert bias. The same expressions as the CPU kernel's.
template <typename scalar_t>
struct SelectValue {
  using A = acc_t<scalar_t>;
  const scalar_t* x;
  const A* bias;
  int sf;
  bool logits, probs, round;
  A m, sd;
  __device__ __forceinline__ A operator()(int64_t j) const {
    const A xj = to_acc(x[j]);
    A u = logits ? xj : probs ? rm::ro_div(rm::ro_exp(xj - m), sd) : rm::score(sf, xj);
    if (round) u = to_acc(from_acc<scalar_t>(u));
    return bias != nullptr ? u + bias[j] : u;
  }
};

template <typename scalar_t>
__device__ __forceinline__ SelectValue<scalar_t> select_value(const GateFwdArgs& a,
                                                              const scalar_t* x,
                                                              RowStats<acc_t<scalar_t>>& st) {
  using A = acc_t<scalar_t>;
  const rm::SelectionParams& p = a.selection;
  const bool probs = p.source == rm::kSelectScores && a.score_func == rm::kSoftmax;
  if (probs) row_stats(x, a.E, st);
  return SelectValue<scalar_t>{x, static_cast<const A*>(a.expert_bias), a.score_func,
                               p.source == rm::kSelectLogits, probs, p.round_scores, st.m,
                               st.s == A(0) ? A(1) : st.s};
}

// The model's own selection of row t into out[0..K) (replay_select.h select_row), in
// rank order. The ranked lists live in the thread's local memory (K, group_topk and
// group_topn <= kMaxSelectList, checked by the host).
template <typename scalar_t>
__device__ __noinline__ void select_into(const GateFwdArgs& a, int64_t t, int32_t* out,
                                         RowStats<acc_t<scalar_t>>& st) {
  using A = acc_t<scalar_t>;
  const scalar_t* x = static_cast<const scalar_t*>(a.logits) + t * a.stride_lt;
  A vals[kMaxSelectList], gvals[kMaxSelectList];
  int32_t ids[kMaxSelectList], gids[kMaxSelectList];
  if (rm::ranks_logits(a.selection, a.expert_bias != nullptr)) {
    rm::select_row(LogitValue<scalar_t>{x}, a.E, a.K, a.selection, out, vals, ids, gvals, gids);
    return;
  }
  rm::select_row(select_value(a, x, st), a.E, a.K, a.selection, out, vals, ids, gvals, gids);
}

// agreement[t] and set_logprob[t] of row t from its used experts (indices32; `selected`:
// the row took the selection itself, so it agrees), by the rule of the CPU kernel
// (replay_select.h is_top_set / same_set / member_logsumexp).
template <typename scalar_t>
__device__ __noinline__ void agreement_row(const GateFwdArgs& a, int64_t t, bool selected,
                                           RowStats<acc_t<scalar_t>>& st) {
  using A = acc_t<scalar_t>;
  const scalar_t* x = static_cast<const scalar_t*>(a.logits) + t * a.stride_lt;
  const int32_t* idx = a.indices32 + t * a.K;
  const int64_t E = a.E, K = a.K;
  const int sf = a.score_func;
  bool agree = selected;
  if (!agree) {
    if (a.selection.num_groups > 0) {
      int32_t sel[kMaxSelectList];
      select_into<scalar_t>(a, t, sel, st);
      agree = rm::same_set(idx, sel, K);
    } else if (rm::ranks_logits(a.selection, a.expert_bias != nullptr)) {
      agree = rm::is_top_set(LogitValue<scalar_t>{x}, E, idx, K);
    } else {
      agree = rm::is_top_set(select_value(a, x, st), E, idx, K);
    }
  }
  a.agreement[t] = agree ? 1 : 0;
  A z[kMaxSelectList];  // the logits at the slots
  for (int64_t k = 0; k < K; ++k) z[k] = idx[k] >= 0 ? to_acc(x[idx[k]]) : A(0);
  A lp;
  if (sf == rm::kSoftmax) {
    row_stats(x, E, st);
    const A lse_s = rm::member_logsumexp(z, idx, K);
    lp = lse_s == rm::neg_inf<A>() ? lse_s : lse_s - (st.m + log(st.s));
  } else {
    A mass = A(0), total = A(0);
    for (int64_t k = 0; k < K; ++k)
      if (rm::first_of_expert(idx, k)) mass += rm::score(sf, z[k]);
    for (int64_t j = 0; j < E; ++j) total += rm::score(sf, to_acc(x[j]));
    lp = mass > A(0) ? log(mass) - log(total) : rm::neg_inf<A>();
  }
  static_cast<A*>(a.set_logprob)[t] = lp;
}

// The int32 experts of token row t into indices32 (one thread): the recorded ids (a value
// outside [0, E) is an empty slot, -1; the range test sees the full-width index, so an int64
// 2^32 + 3 is not expert 3), or the model's own selection for a flagged row, or in dense
// mode the row's flags and its experts after the padding rule (replay_math.h
// dense_slot_expert). Returns whether the row was selected.
template <typename scalar_t, typename index_t>
__device__ __forceinline__ bool resolve_row(const GateFwdArgs& a, int64_t t,
                                            RowStats<acc_t<scalar_t>>& st) {
  const index_t* ip = static_cast<const index_t*>(a.indices) + t * a.stride_it;
  int32_t* i32 = a.indices32 + t * a.K;
  const int64_t E = a.E, K = a.K;
  const bool masked = a.replay_mask != nullptr && !a.replay_mask[t];
  if (a.probs == nullptr) {
    if (masked ||
        (a.padding == rm::kPadSelect && rm::row_flags(ip, a.stride_ik, K, E, false) != 0)) {
      select_into<scalar_t>(a, t, i32, st);
      return true;
    }
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = static_cast<int64_t>(ip[k * a.stride_ik]);
      i32[k] = rm::takes_row(e, E) ? static_cast<int32_t>(e) : -1;
    }
    return false;
  }
  const uint8_t f = rm::row_flags(ip, a.stride_ik, K, E, masked);
  a.row_flags[t] = f;
  if (f != 0 && a.padding == rm::kPadSelect && !(masked && a.fallback != nullptr)) {
    select_into<scalar_t>(a, t, i32, st);
    return true;
  }
  const int64_t* fb = a.fallback != nullptr ? a.fallback + t * K : nullptr;
#pragma unroll 1
  for (int64_t k = 0; k < K; ++k)
    i32[k] = static_cast<int32_t>(rm::dense_slot_expert<uint32_t>(
        ip, a.stride_ik, fb, 1, f, a.padding, t, k, K, E, a.ep_size, a.spread_offset));
  return false;
}

// Gate weights of one token row (one thread), from its int32 experts: the logits dtype into
// `weights`, or the compute type (in dense mode into the [T, K] scratch `weights`; with
// weights_acc into the output); with the agreement outputs also agreement[t] and
// set_logprob[t].
template <typename scalar_t, typename index_t>
__device__ __forceinline__ void gate_row(const GateFwdArgs& a, int64_t t) {
  using A = acc_t<scalar_t>;
  RowStats<A> st;
  const bool selected = resolve_row<scalar_t, index_t>(a, t, st);
  if (a.agreement != nullptr) agreement_row<scalar_t>(a, t, selected, st);
  const scalar_t* x = static_cast<const scalar_t*>(a.logits) + t * a.stride_lt;
  const int32_t* i32 = a.indices32 + t * a.K;
  const int64_t E = a.E, K = a.K;
  const int sf = a.score_func;
  const bool full = sf == rm::kSoftmax && !a.normalize;
  int nvalid = 0;
  bool any = false;
  A m = A(0), s = A(0);
  for (int64_t k = 0; k < K; ++k) {
    const int32_t e = i32[k];
    if (e < 0) continue;
    ++nvalid;
    const A z = to_acc(x[e]);
    if (sf == rm::kSoftmax) {
      if (!full) {
        m = any ? rm::ro_max(m, z) : z;
        any = true;
      }
    } else if (rm::divides_by_sum(a.normalize, 2)) {
      s += rm::score(sf, z);
    }
  }
  if (full) {
    row_stats(x, E, st);
    m = st.m;
    s = st.s;
  } else if (sf == rm::kSoftmax) {
    m = rm::max_or_zero(m, any);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = i32[k];
      if (e >= 0) s += rm::ro_exp(to_acc(x[e]) - m);
    }
  }
  const A scale = static_cast<A>(a.scaling_factor);
  // dense mode's scratch and weights_acc hold the compute type
  const bool dense = a.probs != nullptr || a.weights_acc;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t e = i32[k];
    A v = A(0);
    if (e >= 0) v = rm::gate_weight(sf, a.normalize, to_acc(x[e]), m, s, nvalid, scale);
    if (dense) {
      static_cast<A*>(a.weights)[t * K + k] = v;
    } else {
      static_cast<scalar_t*>(a.weights)[t * K + k] = from_acc<scalar_t>(v);
    }
  }
}

// The smallest normal value of a dtype (the underflow guard).
template <typename T> __device__ __forceinline__ T tiny_normal();
template <> __device__ __forceinline__ float tiny_normal<float>() { return 1.17549435e-38f; }
template <> __device__ __forceinline__ double tiny_normal<double>() {
  return 2.2250738585072014e-308;
}
template <> __device__ __forceinline__ __half tiny_normal<__half>() {
  return __ushort_as_half(static_cast<unsigned short>(0x0400));
}
template <> __device__ __forceinline__ __nv_bfloat16 tiny_normal<__nv_bfloat16>() {
  return __ushort_as_bfloat16(static_cast<unsigned short>(0x0080));
}

// Dense rows [t0, t1) of probs and routing_map, by the whole CTA (every thread calls it):
// zeros, a barrier, then each row's thread writes its routed experts (a repeated expert's
// weights summed in slot order, rounded once; the underflow guard). Rows t0 + i belong to
// thread i, whose gate_row wrote their experts and weights.
template <typename scalar_t>
__device__ __forceinline__ void dense_rows(const GateFwdArgs& a, int64_t t0, int64_t t1) {
  using A = acc_t<scalar_t>;
  const int64_t E = a.E, K = a.K;
  scalar_t* P = static_cast<scalar_t*>(a.probs);
  const scalar_t zero = from_acc<scalar_t>(A(0));
  // 32-bit loop: a 64-bit trip count is a division call (and spills); the rows of one call
  // hold at most kSmallSlots * kMaxExperts < 2^31 elements
  scalar_t* p0 = P + t0 * E;
  uint8_t* m0 = a.routing_map + t0 * E;
  const int32_t n = static_cast<int32_t>((t1 - t0) * E);
#pragma unroll 1
  for (int32_t i = static_cast<int32_t>(threadIdx.x); i < n; i += static_cast<int32_t>(blockDim.x)) {
    p0[i] = zero;
    m0[i] = 0;
  }
  __syncthreads();  // the zeros are written before the routed entries
  const A* W = static_cast<const A*>(a.weights);
  const int32_t rows = static_cast<int32_t>(t1 - t0);
#pragma unroll 1
  for (int32_t r = static_cast<int32_t>(threadIdx.x); r < rows;
       r += static_cast<int32_t>(blockDim.x)) {
    const int64_t t = t0 + r;
    const int32_t* ir = a.indices32 + t * K;
#pragma unroll 1
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = ir[k];
      if (e < 0) continue;
      bool seen = false;
      for (int64_t j = 0; j < k; ++j) seen = seen || ir[j] == e;
      if (seen) continue;
      A sum = A(0);
      for (int64_t j = k; j < K; ++j)
        if (ir[j] == e) sum += W[t * K + j];
      scalar_t v = from_acc<scalar_t>(sum);
      if (a.underflow_guard && to_acc(v) == A(0)) v = tiny_normal<scalar_t>();
      P[t * E + e] = v;
      a.routing_map[t * E + e] = 1;
    }
  }
}

__device__ __forceinline__ int slot_expert(const int32_t* idx32, int64_t s, int64_t s1, int64_t E) {
  const int e = s < s1 ? idx32[s] : -1;
  return rm::takes_row(e, E) ? e : -1;
}

// Count the slots [s0, s1) per expert into h[E] (this warp's row of shared memory).
__device__ __forceinline__ void warp_count(const int32_t* idx32, int64_t s0, int64_t s1,
                                           int64_t E, int32_t* h) {
  const int lane = threadIdx.x & 31;
  for (int64_t base = s0; base < s1; base += 32) {
    const int e = slot_expert(idx32, base + lane, s1, E);
    const unsigned group = __match_any_sync(kFullMask, e);
    if (e >= 0 && lane == __ffs(group) - 1) h[e] += __popc(group);
    __syncwarp();
  }
}

// Scatter the slots [s0, s1) in ascending order; cur[e] is this warp's next row of expert e.
__device__ __forceinline__ void warp_scatter(const int32_t* idx32, int64_t s0, int64_t s1,
                                             int64_t E, int32_t* cur, int32_t* row_id_map,
                                             int32_t* sorted_slots) {
  const int lane = threadIdx.x & 31;
  for (int64_t base = s0; base < s1; base += 32) {
    const int64_t s = base + lane;
    const int e = slot_expert(idx32, s, s1, E);
    const unsigned group = __match_any_sync(kFullMask, e);
    if (e >= 0) {
      const int32_t row = cur[e] + __popc(group & lanemask_lt());
      row_id_map[s] = row;
      sorted_slots[row] = static_cast<int32_t>(s);
    } else if (s < s1) {
      row_id_map[s] = -1;
    }
    __syncwarp();
    if (e >= 0 && lane == __ffs(group) - 1) cur[e] += __popc(group);
    __syncwarp();
  }
}

// off[0..E] = exclusive prefix sum of the counts rounded up to `align` (block-wide).
__device__ void block_offsets(const int32_t* counts, int64_t E, int32_t align, int32_t* off) {
  __shared__ int32_t warp_tot[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  // E <= kMaxExperts: 32-bit index math (a 64-bit division would be a subroutine call).
  const int nE = static_cast<int>(E);
  const int per = (nE + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int e0 = tid * per < nE ? tid * per : nE, e1 = e0 + per < nE ? e0 + per : nE;
  int32_t local = 0;
  for (int e = e0; e < e1; ++e) local += rm::padded_count32(counts[e], align);
  int32_t incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t v = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int32_t v = lane < nwarps ? warp_tot[lane] : 0;
    int32_t wi = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t u = __shfl_up_sync(kFullMask, wi, o);
      if (lane >= o) wi += u;
    }
    if (lane < nwarps) warp_tot[lane] = wi - v;  // exclusive over warps
    if (lane == nwarps - 1) off[E] = wi;
  }
  __syncthreads();
  int32_t run = warp_tot[warp] + incl - local;
  for (int e = e0; e < e1; ++e) {
    off[e] = run;
    run += rm::padded_count32(counts[e], align);
  }
  __syncthreads();
}

// -1 in the padding rows of every expert and in the tail past the used rows.
__device__ __forceinline__ void fill_unused(const int32_t* off, const int32_t* counts, int64_t E,
                                            int64_t n_sorted, int32_t* sorted_slots) {
  // 32-bit loops (E <= kMaxExperts, plan rows < 2^31): a 64-bit trip count is a division
  // call, and a call spills registers. Unsigned: a row below 2^31 plus a stride below 2^31
  // stays below 2^32, where a signed counter would overflow near the 2^31 capacity.
  const uint32_t nE = static_cast<uint32_t>(E), n = static_cast<uint32_t>(n_sorted);
  for (uint32_t e = blockIdx.x; e < nE; e += gridDim.x)
    for (uint32_t r = static_cast<uint32_t>(off[e] + counts[e]) + threadIdx.x;
         r < static_cast<uint32_t>(off[e + 1]); r += blockDim.x)
      sorted_slots[r] = -1;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t r = static_cast<uint32_t>(off[nE]) + blockIdx.x * blockDim.x + threadIdx.x; r < n;
       r += stride)
    sorted_slots[r] = -1;
}

// ---------------------------------------------------------------- single-launch path
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kRowsPerCta) _gate_plan_small_kernel(GateFwdArgs a) {
  extern __shared__ int32_t smem[];
  const int64_t E = a.E, T = a.T, K = a.K;
  int32_t* off = smem;          // [E + 1]
  int32_t* cnt = off + E + 1;   // [E]
  int32_t* wh = cnt + E;        // [kWarps][E]
  const int tid = threadIdx.x, warp = tid >> 5;
  // 32-bit row loop (T*K <= kSmallSlots here): a 64-bit trip count is a division call
  for (int32_t t = tid; t < static_cast<int32_t>(T); t += static_cast<int32_t>(blockDim.x))
    gate_row<scalar_t, index_t>(a, t);
  const int nE = static_cast<int>(E);  // E <= kMaxExperts: 32-bit loops below
  for (int i = tid; i < kWarps * nE; i += blockDim.x) wh[i] = 0;
  __syncthreads();  // indices32 and the zeroed counts are visible to the whole block
  const int64_t TK = T * K, per = (TK + kWarps - 1) / kWarps;
  const int64_t s0 = warp * per < TK ? warp * per : TK;
  const int64_t s1 = s0 + per < TK ? s0 + per : TK;
  warp_count(a.indices32, s0, s1, E, wh + warp * E);
  __syncthreads();
  for (int e = tid; e < nE; e += blockDim.x) {
    int32_t run = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int32_t v = wh[w * nE + e];
      wh[w * nE + e] = run;
      run += v;
    }
    cnt[e] = run;
    a.tokens_per_expert[e] = run;
  }
  __syncthreads();
  block_offsets(cnt, E, static_cast<int32_t>(a.align), off);
  for (int e = tid; e <= nE; e += blockDim.x) a.expert_offsets[e] = off[e];
  for (int w = 0; w < kWarps; ++w)
    for (int e = tid; e < nE; e += blockDim.x) wh[w * nE + e] += off[e];
  __syncthreads();
  warp_scatter(a.indices32, s0, s1, E, wh + warp * E, a.row_id_map, a.sorted_slots);
  fill_unused(off, cnt, E, rm::plan_capacity(T, K, E, a.align), a.sorted_slots);
  // last: the dense rows need only indices32 and the weights (visible since the barriers
  // above), and nothing of the plan stays live across them
  if (a.probs != nullptr) dense_rows<scalar_t>(a, 0, T);
}

// ---------------------------------------------------------------- multi-CTA path
// Phase 1 for chunk c (token rows [256c, 256c + 256)): gate weights, int32 indices, and the
// chunk's slot count per expert into hist[c][*]. `h` is shared memory for E counters.
template <typename scalar_t, typename index_t>
__device__ __forceinline__ void hist_chunk(const GateFwdArgs& a, int32_t* hist, int64_t c,
                                           int32_t* h) {
  const int64_t E = a.E;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) h[e] = 0;
  __syncthreads();
  const int64_t t = c * kRowsPerCta + threadIdx.x;
  if (t < a.T) {
    gate_row<scalar_t, index_t>(a, t);
    for (int64_t k = 0; k < a.K; ++k) {
      const int e = a.indices32[t * a.K + k];
      if (rm::takes_row(e, E)) atomicAdd(&h[e], 1);  // integer count: order-free
    }
  }
  __syncthreads();
  if (a.probs != nullptr) {
    const int64_t t0 = c * kRowsPerCta, t1 = t0 + kRowsPerCta < a.T ? t0 + kRowsPerCta : a.T;
    dense_rows<scalar_t>(a, t0, t1);
  }
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) hist[c * E + e] = h[e];
  __syncthreads();  // h is reused by the next chunk
}

// Dense mode without the plan: the gate rows and dense rows of chunk blockIdx.x.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kRowsPerCta) _gate_dense_rows_kernel(GateFwdArgs a) {
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta;
  const int64_t t1 = t0 + kRowsPerCta < a.T ? t0 + kRowsPerCta : a.T;
  if (t0 + threadIdx.x < t1) gate_row<scalar_t, index_t>(a, t0 + threadIdx.x);
  __syncthreads();
  dense_rows<scalar_t>(a, t0, t1);
}

template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kRowsPerCta) _gate_hist_kernel(GateFwdArgs a, int32_t* hist) {
  extern __shared__ int32_t smem[];  // [E]
  hist_chunk<scalar_t, index_t>(a, hist, blockIdx.x, smem);
}

// Phase 2 for experts [8g, 8g + 8): hist[c][e] becomes the sum of hist[c'][e] over c' < c,
// and counts[e] the total. Thread (segment, lane): lane = expert in the group, segment = a
// contiguous range of chunks; a scan over the segments in shared memory joins them.
constexpr int kScanExperts = 8;
constexpr int kScanSegments = kRowsPerCta / kScanExperts;  // 32

__device__ __forceinline__ void scan_expert_group(int32_t* hist, int64_t nch, int64_t E,
                                                  int32_t* counts, int64_t g) {
  __shared__ int32_t part[kScanSegments][kScanExperts];
  const int lane = threadIdx.x % kScanExperts, seg = threadIdx.x / kScanExperts;
  const int64_t e = g * kScanExperts + lane;
  const int64_t per = (nch + kScanSegments - 1) / kScanSegments;
  const int64_t c0 = seg * per < nch ? seg * per : nch;
  const int64_t c1 = c0 + per < nch ? c0 + per : nch;
  int32_t sum = 0;
  if (e < E)
    for (int64_t c = c0; c < c1; ++c) sum += hist[c * E + e];
  part[seg][lane] = sum;
  __syncthreads();
  if (seg == 0) {
    int32_t run = 0;
    for (int sg = 0; sg < kScanSegments; ++sg) {
      const int32_t v = part[sg][lane];
      part[sg][lane] = run;
      run += v;
    }
    if (e < E) counts[e] = run;
  }
  __syncthreads();
  int32_t run = part[seg][lane];
  if (e < E)
    for (int64_t c = c0; c < c1; ++c) {
      const int32_t v = hist[c * E + e];
      hist[c * E + e] = run;
      run += v;
    }
  __syncthreads();  // part is reused by the next group
}

__global__ void __launch_bounds__(kRowsPerCta) _chunk_scan_kernel(int32_t* hist, int64_t nch,
                                                                 int64_t E, int32_t* counts) {
  scan_expert_group(hist, nch, E, counts, blockIdx.x);
}

// Phase 3 for chunk c: scatter its slots in ascending order. `off` holds the expert offsets
// (shared memory, E + 1), `wh` kWarps * E shared counters.
__device__ __forceinline__ void scatter_chunk(const GateFwdArgs& a, const int32_t* hist,
                                              const int32_t* off, int32_t* wh, int64_t c) {
  const int64_t E = a.E, T = a.T, K = a.K;
  const int tid = threadIdx.x, warp = tid >> 5;
  for (int64_t i = tid; i < kWarps * E; i += blockDim.x) wh[i] = 0;
  __syncthreads();
  const int64_t t0 = c * kRowsPerCta + warp * 32;
  const int64_t s0 = (t0 < T ? t0 : T) * K;
  const int64_t s1 = (t0 + 32 < T ? t0 + 32 : T) * K;  // s1 >= s0: t0 + 32 > t0
  warp_count(a.indices32, s0, s1, E, wh + warp * E);
  __syncthreads();
  for (int64_t e = tid; e < E; e += blockDim.x) {
    int32_t run = off[e] + hist[c * E + e];
    for (int w = 0; w < kWarps; ++w) {
      const int32_t v = wh[w * E + e];
      wh[w * E + e] = run;
      run += v;
    }
  }
  __syncthreads();
  warp_scatter(a.indices32, s0, s1, E, wh + warp * E, a.row_id_map, a.sorted_slots);
  __syncthreads();  // wh is reused by the next chunk
}

__global__ void __launch_bounds__(kRowsPerCta) _gate_scatter_kernel(GateFwdArgs a,
                                                                   const int32_t* hist) {
  extern __shared__ int32_t smem[];
  const int64_t E = a.E;
  int32_t* off = smem;         // [E + 1]
  int32_t* wh = off + E + 1;   // [kWarps][E]
  block_offsets(a.tokens_per_expert, E, static_cast<int32_t>(a.align), off);  // ends with __syncthreads
  if (blockIdx.x == 0)
    for (int64_t e = threadIdx.x; e <= E; e += blockDim.x) a.expert_offsets[e] = off[e];
  scatter_chunk(a, hist, off, wh, blockIdx.x);
  fill_unused(off, a.tokens_per_expert, E, rm::plan_capacity(a.T, a.K, E, a.align),
              a.sorted_slots);
}

// ---------------------------------------------------------------- cooperative path
// The three phases in one launch. The grid is persistent (every CTA resident at once, which
// the cooperative launch guarantees), CTAs stride over the chunks and expert groups, and
// grid.sync() (which also orders the global memory writes) separates the phases.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kRowsPerCta) _gate_plan_coop_kernel(GateFwdArgs a,
                                                                     int32_t* hist) {
  extern __shared__ int32_t smem[];
  namespace cg = cooperative_groups;
  cg::grid_group grid = cg::this_grid();
  const int64_t E = a.E, nch = ceil_div_dev(a.T, kRowsPerCta);
  for (int64_t c = blockIdx.x; c < nch; c += gridDim.x)
    hist_chunk<scalar_t, index_t>(a, hist, c, smem);
  grid.sync();
  const int64_t groups = ceil_div_dev(E, kScanExperts);
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x)
    scan_expert_group(hist, nch, E, a.tokens_per_expert, g);
  grid.sync();
  int32_t* off = smem;         // [E + 1]
  int32_t* wh = off + E + 1;   // [kWarps][E]
  block_offsets(a.tokens_per_expert, E, static_cast<int32_t>(a.align), off);
  if (blockIdx.x == 0)
    for (int64_t e = threadIdx.x; e <= E; e += blockDim.x) a.expert_offsets[e] = off[e];
  for (int64_t c = blockIdx.x; c < nch; c += gridDim.x) scatter_chunk(a, hist, off, wh, c);
  fill_unused(off, a.tokens_per_expert, E, rm::plan_capacity(a.T, a.K, E, a.align),
              a.sorted_slots);
}

// ---------------------------------------------------------------- backward
// The set log-prob gradient of one row (replay_select.h), for an upstream gradient gl of
// set_logprob[t]: every lane holds the whole set (the row's used experts and their logits,
// gathered by shuffles) and computes the same values by the rule of the CPU kernel.
//   softmax:      d/dx_j = gl * ([j in S] exp(x_j - lse_S) - exp(x_j - m) / s)
//   element-wise: d/dx_j = gl * f'(x_j) * ([j in S] / mass_S - 1 / mass_all)
// An empty set, or a mass of 0, has no gradient (`on` false).
template <typename A>
struct SetLogprobGrad {
  bool on = false;
  A gl = A(0), lse_s = A(0), m = A(0), s = A(1), inv_mass = A(0), inv_total = A(0);

  // acc plus the gradient at column j (logit xj, a member of the set or not), added in the
  // CPU kernel's order (softmax: the row's term, then the member's).
  __device__ __forceinline__ A add(A acc, int sf, A xj, bool member) const {
    if (sf == rm::kSoftmax) {
      acc -= gl * rm::ro_div(rm::ro_exp(xj - m), s);
      if (member) acc += gl * rm::ro_exp(xj - lse_s);
      return acc;
    }
    const A d = rm::score_grad(sf, xj, rm::score(sf, xj));
    return acc + gl * d * ((member ? inv_mass : A(0)) - inv_total);
  }
};

// The set statistics of a row's set log-prob gradient (every lane of the warp calls it; lane
// k holds slot k: expert e, valid v, logit z), with the row's softmax statistics (m, s).
// Not inlined: its lists stay out of the backward's registers.
template <typename scalar_t>
__device__ __noinline__ void set_logprob_grad_setup(SetLogprobGrad<acc_t<scalar_t>>& lp,
                                                    const scalar_t* xr, int64_t E, int64_t K,
                                                    int sf, int e, bool v, acc_t<scalar_t> z,
                                                    acc_t<scalar_t> m, acc_t<scalar_t> s) {
  using A = acc_t<scalar_t>;
  const int lane = threadIdx.x & 31;
  int32_t used[kMaxTopK];
  A zs[kMaxTopK];
  for (int kk = 0; kk < K; ++kk) {
    used[kk] = __shfl_sync(kFullMask, v ? e : -1, kk);
    zs[kk] = __shfl_sync(kFullMask, z, kk);
  }
  if (sf == rm::kSoftmax) {
    lp.lse_s = rm::member_logsumexp(zs, used, K);
    lp.on = lp.lse_s != rm::neg_inf<A>();
    lp.m = m;
    lp.s = s;
    return;
  }
  A mass = A(0), lt = A(0);
  for (int kk = 0; kk < K; ++kk)
    if (rm::first_of_expert(used, kk)) mass += rm::score(sf, zs[kk]);
  for (int64_t j = lane; j < E; j += 32) lt += rm::score(sf, to_acc(xr[j]));
  const A total = warp_sum(lt);
  lp.on = mass > A(0);
  lp.inv_mass = rm::ro_div(A(1), mass);
  lp.inv_total = rm::ro_div(A(1), total);
}

// One warp per token row, lane k holds slot k (K <= 32); the dense row is written once.
// The slot gradients come from gw [T, K] (compute type), or with gd != nullptr from the
// dense probs gradient gd [T, E] (logits dtype, strides sgt, sge) at the slot's expert.
// glp: the set_logprob gradient [T] (compute type), or nullptr.
template <typename scalar_t>
__global__ void __launch_bounds__(256) _gate_bwd_kernel(const acc_t<scalar_t>* gw,
                                                        const scalar_t* gd, int64_t sgt,
                                                        int64_t sge, const scalar_t* x,
                                                        const int32_t* idx, int64_t T,
                                                        int64_t E, int64_t K, int sf,
                                                        bool normalize, double scaling,
                                                        const acc_t<scalar_t>* glp,
                                                        scalar_t* out) {
  using A = acc_t<scalar_t>;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const A scale = static_cast<A>(scaling);
  const A neg_inf = -static_cast<A>(INFINITY);
  const bool full = sf == rm::kSoftmax && !normalize;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       t < T; t += warps) {
    const scalar_t* xr = x + t * E;
    scalar_t* orow = out + t * E;
    int e = -1;
    bool v = false;
    A z = A(0), g = A(0);
    if (lane < K) {
      e = idx[t * K + lane];
      v = rm::takes_row(e, E);
      if (v) {
        z = to_acc(xr[e]);
        g = (gd != nullptr ? to_acc(gd[t * sgt + e * sge]) : gw[t * K + lane]) * scale;
      }
    }
    const int nvalid = __popc(__ballot_sync(kFullMask, v));
    // the set log-prob gradient of the row (warp-uniform: every lane reads glp[t])
    SetLogprobGrad<A> lp;
    lp.gl = glp != nullptr ? glp[t] : A(0);
    const bool with_lp = lp.gl != A(0);  // NaN included, as on the CPU
    A dz = A(0), m = A(0), s = A(0), Asum = A(0);
    if (full || (with_lp && sf == rm::kSoftmax)) {
      A lm = neg_inf;
      for (int64_t j = lane; j < E; j += 32) lm = rm::ro_max(lm, to_acc(xr[j]));
      m = warp_max(lm);
      A ls = A(0);
      for (int64_t j = lane; j < E; j += 32) ls += rm::ro_exp(to_acc(xr[j]) - m);
      s = warp_sum(ls);
    }
    if (with_lp) set_logprob_grad_setup<scalar_t>(lp, xr, E, K, sf, e, v, z, m, s);
    if (full) {
      dz = v ? g * rm::ro_div(rm::ro_exp(z - m), s) : A(0);  // a_k
      Asum = warp_sum(dz);
    } else if (sf == rm::kSoftmax) {
      const A mm = warp_max(v ? z : neg_inf);
      const A sm = rm::max_or_zero(mm, nvalid > 0);
      const A ev = v ? rm::ro_exp(z - sm) : A(0);
      const A ssum = warp_sum(ev);
      const A q = rm::ro_div(ev, ssum == A(0) ? A(1) : ssum);
      const A Gs = warp_sum(v ? g * q : A(0));
      dz = v ? rm::softmax_sel_dz(q, g, Gs) : A(0);
    } else {
      const A sc = v ? rm::score(sf, z) : A(0);
      const A S = warp_sum(sc) + static_cast<A>(rm::kNormEps);
      const A D = warp_sum(v ? g * sc : A(0));
      dz = v ? rm::elementwise_dz(sf, normalize, nvalid, z, g, S, D) : A(0);
    }
    for (int64_t j = lane; j < E; j += 32) {
      const A xj = to_acc(xr[j]);
      A base = full ? rm::softmax_full_base(rm::ro_exp(xj - m), s, Asum) : A(0);
      if (lp.on) base = lp.add(base, sf, xj, false);
      orow[j] = from_acc<scalar_t>(base);
    }
    __syncwarp();
    // Column e of a selected slot: base + the slot gradients of that column in k order
    // (+ the set log-prob gradient of a member), written by the first lane that holds it.
    A tot = (full && v) ? rm::softmax_full_base(rm::ro_exp(z - m), s, Asum) : A(0);
    bool first = v;
    for (int kk = 0; kk < K; ++kk) {
      const int ek = __shfl_sync(kFullMask, e, kk);
      const A dk = __shfl_sync(kFullMask, dz, kk);
      if (v && ek == e) {
        tot += dk;
        if (kk < lane) first = false;
      }
    }
    if (v && first) {
      if (lp.on) tot = lp.add(tot, sf, z, true);
      orow[e] = from_acc<scalar_t>(tot);
    }
    __syncwarp();
  }
}

// The path that gate_fwd takes for these sizes (kAuto resolved except for the cooperative
// versus three-launch choice, which depends on the device).
GatePath resolve_path(int64_t T, int64_t K, GatePath path, int64_t dense_elems) {
  // T == 0 has no chunks: the single CTA writes the empty plan whatever the path. A dense
  // output above kSmallDenseElems is written by many CTAs, not one.
  if ((path == GatePath::kAuto && T * K <= kSmallSlots && dense_elems <= kSmallDenseElems) ||
      T == 0)
    return GatePath::kSingleCta;
  return path;
}

// How many CTAs of the cooperative kernel can be resident at once on the current device
// (0 where the device cannot launch cooperative kernels). Queried on every call: the
// attribute and occupancy queries are host-side and cheap, and nothing is cached, so
// concurrent callers share no state.
template <typename Kernel>
cudaError_t coop_capacity(Kernel kernel, size_t smem, int64_t& ctas) {
  ctas = 0;
  int dev = 0, coop = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess || coop == 0 || sms <= 0) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kRowsPerCta, smem);
  if (err != cudaSuccess) return err;
  ctas = static_cast<int64_t>(per_sm) * sms;
  return cudaSuccess;
}

template <typename scalar_t, typename index_t>
cudaError_t launch_gate_fwd(const GateFwdArgs& a, void* workspace, cudaStream_t stream,
                            GatePath path) {
  if (!a.with_plan) {  // gate_dense's rows alone
    // before any test of `probs`: a [0, E] tensor has no data pointer
    if (a.T == 0) return cudaSuccess;
    if (a.probs == nullptr) return cudaErrorInvalidValue;
    _gate_dense_rows_kernel<scalar_t, index_t>
        <<<static_cast<unsigned>(ceil_div(a.T, kRowsPerCta)), kRowsPerCta, 0, stream>>>(a);
    return cudaGetLastError();
  }
  // the plan's outputs: [E] and [E + 1] (E >= 1), never empty; sorted_slots may be (T*K = 0)
  if (a.tokens_per_expert == nullptr || a.expert_offsets == nullptr ||
      (a.row_id_map == nullptr && a.T * a.K > 0)) {
    return cudaErrorInvalidValue;
  }
  path = resolve_path(a.T, a.K, path, a.probs != nullptr ? a.T * a.E : 0);
  if (path == GatePath::kSingleCta) {
    if (a.T * a.K > kSmallSlots) return cudaErrorInvalidValue;
    const size_t smem = static_cast<size_t>(10 * a.E + 1) * sizeof(int32_t);
    _gate_plan_small_kernel<scalar_t, index_t><<<1, kRowsPerCta, smem, stream>>>(a);
    return cudaGetLastError();
  }
  const int64_t nch = ceil_div(a.T, kRowsPerCta);
  int32_t* hist = static_cast<int32_t*>(workspace);
  if (hist == nullptr) return cudaErrorInvalidValue;
  const size_t plan_smem = static_cast<size_t>((kWarps + 1) * a.E + 1) * sizeof(int32_t);
  if (path == GatePath::kAuto) {
    // Under stream capture a failed cooperative launch invalidates the whole capture, so the
    // fallback below could not recover: `auto` takes the three launches there (same bits).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaStreamIsCapturing(stream, &capture);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // returned here, not left for the next launch check
      return err;
    }
    if (capture != cudaStreamCaptureStatusNone) path = GatePath::kThreeLaunches;
  }
  if (path == GatePath::kAuto || path == GatePath::kCooperative) {
    auto kernel = _gate_plan_coop_kernel<scalar_t, index_t>;
    int64_t ctas = 0;
    cudaError_t err = coop_capacity(kernel, plan_smem, ctas);
    if (err != cudaSuccess) return err;
    if (a.max_ctas > 0 && ctas > a.max_ctas) ctas = a.max_ctas;
    if (ctas > 0) {
      const unsigned grid = static_cast<unsigned>(nch < ctas ? nch : ctas);
      GateFwdArgs args = a;
      void* params[] = {&args, &hist};
      err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(grid),
                                        dim3(kRowsPerCta), params, plan_smem, stream);
      if (err == cudaSuccess) return cudaSuccess;
      (void)cudaGetLastError();  // clear it: the error is returned, or the fallback runs
      if (path == GatePath::kCooperative) return err;
      // kAuto: e.g. fewer SMs usable than reported (MPS limits); the three launches below
      // give the same bits.
    } else if (path == GatePath::kCooperative) {
      return cudaErrorNotSupported;
    }
  }
  _gate_hist_kernel<scalar_t, index_t>
      <<<static_cast<unsigned>(nch), kRowsPerCta, a.E * sizeof(int32_t), stream>>>(a, hist);
  _chunk_scan_kernel<<<static_cast<unsigned>(ceil_div(a.E, kScanExperts)), kRowsPerCta, 0,
                       stream>>>(hist, nch, a.E, a.tokens_per_expert);
  _gate_scatter_kernel<<<static_cast<unsigned>(nch), kRowsPerCta, plan_smem, stream>>>(a, hist);
  return cudaGetLastError();
}

}  // namespace

size_t gate_fwd_workspace_bytes(int64_t T, int64_t E, int64_t K, GatePath path, bool dense) {
  if (resolve_path(T, K, path, dense ? T * E : 0) == GatePath::kSingleCta) return 0;
  return static_cast<size_t>(detail::ceil_div(T, kRowsPerCta) * E) * sizeof(int32_t);
}

cudaError_t gate_fwd(const GateFwdArgs& a, void* workspace, cudaStream_t stream, GatePath path) {
  if (a.E < 1 || a.E > kMaxExperts || a.K < 1 || a.T < 0 || a.align < 1) {
    return cudaErrorInvalidValue;
  }
  if (gate_selects(a) &&
      (a.K > kMaxSelectList || a.selection.group_topk > kMaxSelectList ||
       a.selection.group_topn > kMaxSelectList ||
       (a.agreement != nullptr && a.T > 0 && a.set_logprob == nullptr))) {
    return cudaErrorInvalidValue;
  }
  RO_CUDA_DISPATCH_FLOAT(a.logits_dtype, RO_CUDA_DISPATCH_INDEX(a.index_dtype, {
    return launch_gate_fwd<scalar_t, index_t>(a, workspace, stream, path);
  }));
  return cudaSuccess;
}

cudaError_t gate_bwd(const void* grad_weights_acc, const void* logits, DType logits_dtype,
                     const int32_t* indices32, int64_t T, int64_t E, int64_t K, int score_func,
                     bool normalize, double scaling_factor, void* grad_logits,
                     cudaStream_t stream, const void* grad_set_logprob_acc) {
  if (E < 1 || K < 1 || K > kMaxTopK || T < 0) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const unsigned grid = detail::grid_1d(detail::ceil_div(T, 8));
  RO_CUDA_DISPATCH_FLOAT(logits_dtype, {
    _gate_bwd_kernel<scalar_t><<<grid, 256, 0, stream>>>(
        static_cast<const detail::acc_t<scalar_t>*>(grad_weights_acc), nullptr, 0, 0,
        static_cast<const scalar_t*>(logits), indices32, T, E, K, score_func, normalize,
        scaling_factor,
        static_cast<const detail::acc_t<scalar_t>*>(grad_set_logprob_acc),
        static_cast<scalar_t*>(grad_logits));
    return cudaGetLastError();
  });
  return cudaSuccess;
}

cudaError_t gate_dense_bwd(const void* grad_probs, int64_t stride_gt, int64_t stride_ge,
                           const void* logits, DType logits_dtype, const int32_t* indices32,
                           int64_t T, int64_t E, int64_t K, int score_func, bool normalize,
                           double scaling_factor, void* grad_logits, cudaStream_t stream,
                           const void* grad_set_logprob_acc) {
  if (E < 1 || K < 1 || K > kMaxTopK || T < 0) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;  // a [0, E] gradient has no data pointer
  if (grad_probs == nullptr) return cudaErrorInvalidValue;
  const unsigned grid = detail::grid_1d(detail::ceil_div(T, 8));
  RO_CUDA_DISPATCH_FLOAT(logits_dtype, {
    _gate_bwd_kernel<scalar_t><<<grid, 256, 0, stream>>>(
        nullptr, static_cast<const scalar_t*>(grad_probs), stride_gt, stride_ge,
        static_cast<const scalar_t*>(logits), indices32, T, E, K, score_func, normalize,
        scaling_factor,
        static_cast<const detail::acc_t<scalar_t>*>(grad_set_logprob_acc),
        static_cast<scalar_t*>(grad_logits));
    return cudaGetLastError();
  });
  return cudaSuccess;
}

}  // namespace replay_cuda
