// CPU kernels of replay_native::{permute,unpermute}_{fwd,bwd}.
//
// permute_fwd   out[r]      = hidden[sorted_slots[r] / K], zero for padding and tail rows
// permute_bwd   grad[t]     = sum_k grad_out[row_id_map[t, k]]              (gather-sum)
// unpermute_fwd out[t]      = sum_k weights[t, k] * expert_out[row_id_map[t, k]]
// unpermute_bwd grad_x[r]   = weights[s] * grad_out[s / K] for the slot s of row r
//               grad_w[t,k] = <grad_out[t], expert_out[row_id_map[t, k]]>
// permute_probs_fwd  out[r] = probs[t, e] of the slot s of row r (t = s / K, e = idx[t, s % K])
// permute_probs_bwd  grad_probs[t, e] = sum_k grad[row_id_map[t, k]] over the slots of row t
//                    routed to e (dense [T, E], each row written whole by one task)
// Sums over k run in column order k = 0..K-1 in fp32 (fp64 for fp64), like the reference;
// a row id outside [0, rows), and a slot whose token is outside [0, T), contributes nothing
// and is never read. Every output element has one owner, so the results are the same for
// any thread count.
#include <cstring>
#include <vector>

#include "../bindings/native_checks.h"
#include "cpu_common.h"
#include "ops_cpu.h"

namespace replay_cpu {
namespace rm = replay_math;

namespace {

// Rows per parallel task: at least ~64 KiB of row data per task.
inline int64_t row_grain(int64_t H, int64_t elem) {
  return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, H * elem));
}

at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

const c10::Device kCpu(c10::kCPU);

#define RO_DISPATCH_FLOAT(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

}  // namespace

at::Tensor permute_fwd(const at::Tensor& hidden_in, const at::Tensor& sorted_slots_in,
                       const at::Tensor& row_id_map, int64_t num_rows) {
  replay_native::check_permute_fwd(hidden_in, sorted_slots_in, row_id_map, num_rows, kCpu);
  const at::Tensor hidden = hidden_in.contiguous();
  const at::Tensor ss = sorted_slots_in.contiguous();
  const int64_t T = hidden.size(0), H = hidden.size(1), K = row_id_map.size(1);
  const int64_t n_ss = ss.numel();
  at::Tensor out = at::empty({num_rows, H}, hidden.options());
  if (num_rows == 0 || H == 0) return out;
  const int64_t bytes = H * static_cast<int64_t>(hidden.element_size());
  const char* src = static_cast<const char*>(hidden.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int32_t* S = ss.data_ptr<int32_t>();
  at::parallel_for(0, num_rows, row_grain(H, hidden.element_size()), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t slot = r < n_ss ? S[r] : -1;
      const int64_t t = slot >= 0 && K > 0 ? rm::slot_token(slot, K) : -1;
      if (t >= 0 && t < T) {
        std::memcpy(dst + r * bytes, src + t * bytes, static_cast<size_t>(bytes));
      } else {
        std::memset(dst + r * bytes, 0, static_cast<size_t>(bytes));
      }
    }
  });
  return out;
}

namespace {

// out[t] = sum_k w[t, k] * x[row_id_map[t, k]]  (w == nullptr: weight 1, the gather-sum).
template <typename scalar_t>
void weighted_gather_sum(const at::Tensor& x, const at::Tensor& rid, const at::Tensor* w,
                         at::Tensor& out) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t R = x.size(0), H = x.size(1), T = rid.size(0), K = rid.size(1);
  const scalar_t* X = x.data_ptr<scalar_t>();
  const int32_t* RID = rid.data_ptr<int32_t>();
  const acc_t* Wp = w ? w->data_ptr<acc_t>() : nullptr;
  scalar_t* O = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, row_grain(H * K, sizeof(scalar_t)), [&](int64_t t0, int64_t t1) {
    std::vector<acc_t> acc(static_cast<size_t>(H));
    for (int64_t t = t0; t < t1; ++t) {
      acc_t* a = acc.data();
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = RID[t * K + k];
        if (r < 0 || r >= R) continue;
        const scalar_t* xr = X + r * H;
        if (Wp) {
          const acc_t wk = Wp[t * K + k];
          for (int64_t h = 0; h < H; ++h) a[h] += wk * static_cast<acc_t>(xr[h]);
        } else {
          for (int64_t h = 0; h < H; ++h) a[h] += static_cast<acc_t>(xr[h]);
        }
      }
      scalar_t* o = O + t * H;
      for (int64_t h = 0; h < H; ++h) o[h] = static_cast<scalar_t>(a[h]);
    }
  });
}

// <a, b>, accumulated in fp64 with kLanes interleaved partial sums combined by a fixed
// pairwise tree, then rounded once to the compute type. A plain left-to-right fp32 sum over
// thousands of hidden units loses about sqrt(H) times more than PyTorch's cascaded sum;
// fp64 partials keep the result within one rounding of the exact dot product, and the
// fixed order keeps it deterministic.
constexpr int kLanes = 16;
template <typename scalar_t, typename acc_t = acc_type_t<scalar_t>>
acc_t dot(const scalar_t* a, const scalar_t* b, int64_t H) {
  double part[kLanes] = {};
  int64_t h = 0;
  for (; h + kLanes <= H; h += kLanes)
    for (int l = 0; l < kLanes; ++l)
      part[l] += static_cast<double>(a[h + l]) * static_cast<double>(b[h + l]);
  for (int l = 0; h < H; ++h, ++l) part[l] += static_cast<double>(a[h]) * static_cast<double>(b[h]);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return static_cast<acc_t>(part[0]);
}

}  // namespace

at::Tensor permute_bwd(const at::Tensor& grad_out_in, const at::Tensor& row_id_map_in) {
  replay_native::check_gather_sum(grad_out_in, row_id_map_in, nullptr, "permute_backward", kCpu);
  const at::Tensor g = grad_out_in.contiguous();
  const at::Tensor rid = row_id_map_in.contiguous();
  at::Tensor out = at::empty({rid.size(0), g.size(1)}, g.options());
  if (out.numel() == 0) return out;
  RO_DISPATCH_FLOAT(g.scalar_type(), "replay_native_permute_bwd", [&] {
    weighted_gather_sum<scalar_t>(g, rid, nullptr, out);
  });
  return out;
}

at::Tensor unpermute_fwd(const at::Tensor& expert_out_in, const at::Tensor& row_id_map_in,
                         const at::Tensor& weights) {
  replay_native::check_gather_sum(expert_out_in, row_id_map_in, &weights, "unpermute", kCpu);
  const at::Tensor x = expert_out_in.contiguous();
  const at::Tensor rid = row_id_map_in.contiguous();
  const at::Tensor w = weights.to(acc_dtype(x.scalar_type())).contiguous();
  at::Tensor out = at::empty({rid.size(0), x.size(1)}, x.options());
  if (out.numel() == 0) return out;
  RO_DISPATCH_FLOAT(x.scalar_type(), "replay_native_unpermute_fwd", [&] {
    weighted_gather_sum<scalar_t>(x, rid, &w, out);
  });
  return out;
}

replay_native::UnpermuteBwdResult unpermute_bwd(const at::Tensor& grad_out_in,
                                                const at::Tensor& expert_out_in,
                                                const at::Tensor& row_id_map_in,
                                                const at::Tensor& sorted_slots_in,
                                                const at::Tensor& weights) {
  replay_native::check_unpermute_bwd(grad_out_in, expert_out_in, row_id_map_in, sorted_slots_in,
                                     weights, kCpu);
  const at::Tensor x = expert_out_in.contiguous();
  const at::Tensor go = grad_out_in.to(x.scalar_type()).contiguous();
  const at::Tensor rid = row_id_map_in.contiguous();
  const at::Tensor ss = sorted_slots_in.contiguous();
  const auto adt = acc_dtype(x.scalar_type());
  const at::Tensor w = weights.to(adt).contiguous();
  const int64_t R = x.size(0), H = x.size(1), T = rid.size(0), K = rid.size(1);
  const int64_t n_ss = ss.numel();
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor grad_w_acc = at::empty({T, K}, x.options().dtype(adt));
  RO_DISPATCH_FLOAT(x.scalar_type(), "replay_native_unpermute_bwd", [&] {
    using acc_t = acc_type_t<scalar_t>;
    const scalar_t* X = x.data_ptr<scalar_t>();
    const scalar_t* GO = go.data_ptr<scalar_t>();
    const int32_t* RID = rid.data_ptr<int32_t>();
    const int32_t* S = ss.data_ptr<int32_t>();
    const acc_t* Wp = w.data_ptr<acc_t>();
    scalar_t* GX = grad_x.data_ptr<scalar_t>();
    acc_t* GW = grad_w_acc.data_ptr<acc_t>();
    // grad_x: row r copies grad_out of its token, scaled by the slot's weight.
    at::parallel_for(0, R, row_grain(H, sizeof(scalar_t)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t s = r < n_ss ? S[r] : -1;
        const int64_t t = s >= 0 && K > 0 ? rm::slot_token(s, K) : -1;
        scalar_t* gx = GX + r * H;
        if (t < 0 || t >= T) {
          for (int64_t h = 0; h < H; ++h) gx[h] = scalar_t(0);
          continue;
        }
        const acc_t ws = Wp[s];
        const scalar_t* g = GO + t * H;
        for (int64_t h = 0; h < H; ++h) gx[h] = static_cast<scalar_t>(ws * static_cast<acc_t>(g[h]));
      }
    });
    // grad_w: one dot product per valid slot.
    at::parallel_for(0, T, row_grain(H * K, sizeof(scalar_t)), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* g = GO + t * H;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = RID[t * K + k];
          acc_t d = acc_t(0);
          if (r >= 0 && r < R) d = dot(g, X + r * H, H);
          GW[t * K + k] = d;
        }
      }
    });
  });
  return {grad_x, grad_w_acc.to(weights.scalar_type())};
}

at::Tensor permute_probs_fwd(const at::Tensor& probs_in, const at::Tensor& sorted_slots_in,
                             const at::Tensor& expert_indices_in, int64_t num_rows) {
  replay_native::check_permute_probs_fwd(probs_in, sorted_slots_in, expert_indices_in, num_rows,
                                         kCpu);
  const at::Tensor ss = sorted_slots_in.contiguous();
  const at::Tensor idx = expert_indices_in.contiguous();
  const int64_t T = probs_in.size(0), E = probs_in.size(1), K = idx.size(1), n_ss = ss.numel();
  at::Tensor out = at::empty({num_rows}, probs_in.options());
  if (num_rows == 0) return out;
  RO_DISPATCH_FLOAT(probs_in.scalar_type(), "replay_native_permute_probs_fwd", [&] {
    const scalar_t* P = probs_in.data_ptr<scalar_t>();  // read in place, any strides
    const int64_t spt = probs_in.stride(0), spe = probs_in.stride(1);
    const int32_t* S = ss.data_ptr<int32_t>();
    const int32_t* I = idx.data_ptr<int32_t>();
    scalar_t* O = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_rows, 1 << 14, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t s = r < n_ss ? S[r] : -1;
        const int64_t t = s >= 0 && K > 0 ? rm::slot_token(s, K) : -1;
        const int64_t e = t >= 0 && t < T ? I[s] : -1;
        O[r] = rm::takes_row(e, E) ? P[t * spt + e * spe] : scalar_t(0);
      }
    });
  });
  return out;
}

at::Tensor permute_probs_bwd(const at::Tensor& grad_in, const at::Tensor& row_id_map_in,
                             const at::Tensor& expert_indices_in, int64_t num_experts) {
  replay_native::check_permute_probs_bwd(grad_in, row_id_map_in, expert_indices_in, num_experts,
                                         kCpu);
  const at::Tensor g = grad_in.contiguous();
  const at::Tensor rid = row_id_map_in.contiguous();
  const at::Tensor idx = expert_indices_in.contiguous();
  const int64_t T = rid.size(0), K = rid.size(1), R = g.size(0), E = num_experts;
  at::Tensor out = at::empty({T, E}, g.options());
  if (out.numel() == 0) return out;
  RO_DISPATCH_FLOAT(g.scalar_type(), "replay_native_permute_probs_bwd", [&] {
    using acc_t = acc_type_t<scalar_t>;
    const scalar_t* G = g.data_ptr<scalar_t>();
    const int32_t* RID = rid.data_ptr<int32_t>();
    const int32_t* I = idx.data_ptr<int32_t>();
    scalar_t* O = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(E, 1)),
                     [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        scalar_t* o = O + t * E;
        std::fill(o, o + E, scalar_t(0));
        const int32_t* ir = I + t * K;
        const int32_t* rr = RID + t * K;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t e = ir[k];
          if (!rm::takes_row(e, E)) continue;
          bool seen = false;  // a repeated expert is written once, by its first slot
          for (int64_t j = 0; j < k; ++j) seen = seen || (ir[j] == e && rr[j] >= 0 && rr[j] < R);
          if (seen) continue;
          acc_t sum = acc_t(0);
          bool any = false;
          for (int64_t j = k; j < K; ++j)
            if (ir[j] == e && rr[j] >= 0 && rr[j] < R) {
              sum += static_cast<acc_t>(G[rr[j]]);
              any = true;
            }
          if (any) o[e] = static_cast<scalar_t>(sum);
        }
      }
    });
  });
  return out;
}

// Each op's name is one function here, of its signature in native_ops.inc.
REPLAY_NATIVE_OPS(REPLAY_NATIVE_CHECK_ONE)

}  // namespace replay_cpu
