// CPU kernels of replay_native::gate_fwd and replay_native::gate_bwd.
//
// Forward, in the three phases of the CUDA gate (csrc/cuda/gate_kernels.cu), over fixed
// token chunks:
//   1. per chunk, in parallel (hist_chunk): the int32 indices (-1 for any value outside
//      [0, E)), the gate weights (gate_row), the chunk's slot count per expert;
//   2. a serial scan over (chunk, expert) (scan_chunks): each chunk's first row per expert,
//      the counts, the aligned offsets, -1 in the padding rows and the tail;
//   3. per chunk, in parallel (scatter_chunk): the slots take their rows in ascending
//      flat-slot order.
// The result (expert-major, ascending flat slot t*K+k within an expert, padding rows at the
// end of each expert segment, -1 in padding and tail) never depends on thread timing: the
// chunks are fixed by the sizes, every write has exactly one owner, and there are no atomics.
//
// Dense mode (gate_dense_fwd, Megatron-Core's contract): phase 1 also writes the row's flags,
// routes a flagged row by the padding mode (replay_math.h dense_slot_expert), and writes the
// whole dense row of probs [T, E] and routing_map [T, E] (zeros, then the routed experts;
// a repeated expert's weights summed in slot order, rounded once; the underflow guard). The
// plan phases run only with with_plan. Its backward reads the dense probs gradient at the
// routed experts (any strides) and runs the gate backward of gate_bwd.
//
// The model's own selection (replay_select.h) runs in phase 1, inside resolve_row, for the
// flagged rows only (replay_mask False; with padding "select" a row with flags): their
// selection values over the E logits, then a partial selection of K, in the same pass that
// computes the row's weights. Unflagged rows cost nothing more. With the agreement outputs,
// every row is selected (a flagged row agrees by construction) and its set log-probability
// is computed from the same row; the backward adds the set log-prob gradient to the row it
// writes.
#include <cmath>
#include <limits>
#include <vector>

#include "../bindings/native_checks.h"
#include "cpu_common.h"
#include "ops_cpu.h"
#include "replay_select.h"
#include "row_kernels.h"

namespace replay_cpu {
namespace rm = replay_math;

namespace {

// Slots per chunk. NOTE: 2048 slots keep a chunk's histogram and rows in L1/L2 and give
// 64 chunks at T=16384, K=8, enough to balance two to a few dozen threads.
constexpr int64_t kSlotsPerChunk = 2048;

// The tensors of one gate call, as raw pointers (the CPU counterpart of GateFwdArgs).
template <typename scalar_t, typename index_t>
struct GateFwd {
  using acc_t = acc_type_t<scalar_t>;
  const scalar_t* X;  // logits [T, E], contiguous
  const index_t* I;   // indices [T, K], strides (st, sk)
  int64_t st, sk, T, E, K, align, n_sorted;
  int sf;
  bool normalize;
  acc_t scale;
  RowKernels<scalar_t> rk;
  scalar_t* W = nullptr;  // weights [T, K], or
  acc_t* WA = nullptr;    // the weights in the compute type (weights_acc)
  int32_t* I32;  // indices used [T, K]: -1 for empty slots (any value outside [0, E))
  int32_t* CNT;  // tokens_per_expert [E]
  int32_t* OFF;  // expert_offsets [E + 1]
  int32_t* RID;  // row_id_map [T, K]
  int32_t* SS;   // sorted_slots [n_sorted]
  int64_t tok_per_chunk, nch;
  std::vector<int32_t> hist;  // [nch][E]: the chunk's count, then its first row, per expert
  const bool* MASK = nullptr;  // replay_mask [T] or nullptr: False rows are selected
  int padding = rm::kPadEmpty;  // kPadSelect: rows with flags are selected too
  // the model's own selection (replay_select.h) and the agreement outputs
  rm::SelectionParams sel{rm::kSelectScores, false, 0, 0, 0};
  const acc_t* BIAS = nullptr;  // expert_bias [E] in the compute type, or nullptr
  bool* AGREE = nullptr;        // agreement [T], or nullptr (not asked for)
  acc_t* LP = nullptr;          // set_logprob [T] (with AGREE)
  // dense mode (P != nullptr)
  scalar_t* P = nullptr;      // probs [T, E]
  bool* MAP = nullptr;        // routing_map [T, E]
  uint8_t* FLAGS = nullptr;   // row_flags [T]
  const int64_t* FB = nullptr;  // fallback [T, K] (contiguous int64) or nullptr
  int64_t ep = 1, offset_mod = 0;
  bool guard = false, with_plan = true;

  // A thread's scratch for the rows it gates.
  struct Scratch {
    std::vector<acc_t> z, v, rvals, gvals;
    std::vector<char> valid;
    std::vector<int32_t> rids, gids, sel;
    bool stats = false;  // (m, s): the row's softmax statistics over all E are computed
    acc_t m = acc_t(0), s = acc_t(0);
  };

  Scratch scratch() const {
    Scratch w;
    const int64_t n = std::max<int64_t>(K, sel.group_topn);
    w.z.resize(static_cast<size_t>(K));
    w.valid.resize(static_cast<size_t>(K));
    if (MASK || padding == rm::kPadSelect || AGREE) {
      w.v.resize(static_cast<size_t>(E));
      w.rvals.resize(static_cast<size_t>(n));
      w.rids.resize(static_cast<size_t>(n));
      w.gvals.resize(static_cast<size_t>(std::max<int64_t>(sel.group_topk, 1)));
      w.gids.resize(static_cast<size_t>(std::max<int64_t>(sel.group_topk, 1)));
      w.sel.resize(static_cast<size_t>(K));
    }
    return w;
  }

  // The row's softmax statistics over all E (computed once per row).
  void row_stats(const scalar_t* x, Scratch& w) const {
    if (!w.stats) rk.softmax_stats(x, E, w.m, w.s);
    w.stats = true;
  }

  // The model's own selection of row t into out[0..K) (replay_select.h): the selection
  // values v_j of the row (the scores or the logits, rounded to the logits dtype if asked,
  // plus the bias), then a partial selection of K.
  void select_into(int64_t t, int32_t* out, Scratch& w) const {
    const scalar_t* x = X + t * E;
    if (rm::ranks_logits(sel, BIAS != nullptr)) {  // v_j = x_j: no score is computed
      rm::select_row([x](int64_t j) { return static_cast<acc_t>(x[j]); }, E, K, sel, out,
                     w.rvals.data(), w.rids.data(), w.gvals.data(), w.gids.data());
      return;
    }
    const acc_t* v = values(t, w);
    rm::select_row([v](int64_t j) { return v[j]; }, E, K, sel, out, w.rvals.data(),
                   w.rids.data(), w.gvals.data(), w.gids.data());
  }

  // Whether the used experts idx of row t are the selection's set (replay_select.h).
  bool agrees(int64_t t, const int32_t* idx, Scratch& w) const {
    if (sel.num_groups > 0) {
      select_into(t, w.sel.data(), w);
      return rm::same_set(idx, w.sel.data(), K);
    }
    const scalar_t* x = X + t * E;
    if (rm::ranks_logits(sel, BIAS != nullptr))
      return rm::is_top_set([x](int64_t j) { return static_cast<acc_t>(x[j]); }, E, idx, K);
    const acc_t* v = values(t, w);
    return rm::is_top_set([v](int64_t j) { return v[j]; }, E, idx, K);
  }

  // The selection values v_j of row t (scratch w.v).
  const acc_t* values(int64_t t, Scratch& w) const {
    const scalar_t* x = X + t * E;
    acc_t* v = w.v.data();
    const bool probs = sel.source == rm::kSelectScores && sf == rm::kSoftmax;
    if (probs) row_stats(x, w);
    const acc_t sd = w.s == acc_t(0) ? acc_t(1) : w.s;
    for (int64_t j = 0; j < E; ++j) {
      const acc_t xj = static_cast<acc_t>(x[j]);
      acc_t u = sel.source == rm::kSelectLogits ? xj
                : probs                         ? rm::ro_div(rm::ro_exp(xj - w.m), sd)
                                                : rm::score(sf, xj);
      if (sel.round_scores) u = static_cast<acc_t>(static_cast<scalar_t>(u));
      v[j] = BIAS ? u + BIAS[j] : u;
    }
    return v;
  }

  // agreement[t] and set_logprob[t] of the row's used experts idx (selected: the row was
  // selected itself, so it agrees).
  void agreement_row(int64_t t, const int32_t* idx, bool selected, Scratch& w) const {
    const scalar_t* x = X + t * E;
    AGREE[t] = selected || agrees(t, idx, w);
    acc_t* z = w.rvals.data();  // the logits at the slots (scratch of at least K)
    for (int64_t k = 0; k < K; ++k) z[k] = idx[k] >= 0 ? static_cast<acc_t>(x[idx[k]]) : acc_t(0);
    acc_t lp;
    if (sf == rm::kSoftmax) {
      row_stats(x, w);
      const acc_t lse_s = rm::member_logsumexp(z, idx, K);
      lp = lse_s == rm::neg_inf<acc_t>() ? lse_s : lse_s - (w.m + std::log(w.s));
    } else if (sf == rm::kSigmoid || sf == rm::kSqrtsoftplus) {
      acc_t mass = acc_t(0), total = acc_t(0);
      for (int64_t k = 0; k < K; ++k)
        if (rm::first_of_expert(idx, k)) mass += rm::score(sf, z[k]);
      for (int64_t j = 0; j < E; ++j) total += rm::score(sf, static_cast<acc_t>(x[j]));
      lp = mass > acc_t(0) ? std::log(mass) - std::log(total) : rm::neg_inf<acc_t>();
    } else {
      TORCH_CHECK(false, "replay_ops native gate: unknown score function id ", sf);
    }
    LP[t] = lp;
  }

  // The int32 experts of row t into I32: the recorded ids (a value outside [0, E) is an
  // empty slot; the range test sees the full-width index), or the model's own selection for
  // a flagged row, or in dense mode the row's flags and its experts after the padding rule.
  // Returns whether the row was selected.
  bool resolve_row(int64_t t, Scratch& w) const {
    int32_t* out = I32 + t * K;
    const index_t* ip = I + t * st;
    const bool masked = MASK != nullptr && !MASK[t];
    if (P == nullptr) {
      const bool flagged =
          masked || (padding == rm::kPadSelect && rm::row_flags(ip, sk, K, E, false) != 0);
      if (flagged) {
        select_into(t, out, w);
        return true;
      }
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = static_cast<int64_t>(ip[k * sk]);
        out[k] = rm::takes_row(e, E) ? static_cast<int32_t>(e) : -1;
      }
      return false;
    }
    const uint8_t f = rm::row_flags(ip, sk, K, E, masked);
    FLAGS[t] = f;
    if (f != 0 && padding == rm::kPadSelect && !(masked && FB)) {
      select_into(t, out, w);
      return true;
    }
    const int64_t* fb = FB ? FB + t * K : nullptr;
    for (int64_t k = 0; k < K; ++k)
      out[k] = static_cast<int32_t>(rm::dense_slot_expert<uint64_t>(
          ip, sk, fb, 1, f, padding, t, k, K, E, ep, offset_mod));
    return false;
  }

  // Dense row t: zeros, then each routed expert's weight (the slots of a repeated expert
  // summed in slot order in the compute type, rounded once), the underflow guard.
  void write_dense_row(int64_t t, const acc_t* w) const {
    scalar_t* p = P + t * E;
    bool* m = MAP + t * E;
    std::fill(p, p + E, scalar_t(0));
    std::fill(m, m + E, false);
    const int32_t* idx = I32 + t * K;
    // A row without flags routes K distinct recorded experts, and the spread rule and the
    // selection give K distinct ones: each entry is one slot's weight (0 + w: the same bits
    // as the sum).
    const uint8_t f = FLAGS[t];
    const bool distinct = padding == rm::kPadSpread || padding == rm::kPadSelect;
    if (f == 0 || (distinct && !(f & rm::kRowMasked && FB))) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[k];
        if (e < 0) continue;
        scalar_t v = static_cast<scalar_t>(acc_t(0) + w[k]);
        if (guard && v == scalar_t(0)) v = std::numeric_limits<scalar_t>::min();
        p[e] = v;
        m[e] = true;
      }
      return;
    }
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[k];
      if (e < 0 || m[e]) continue;  // empty, or a repeat already written
      acc_t sum = acc_t(0);
      for (int64_t j = k; j < K; ++j)
        if (idx[j] == e) sum += w[j];
      scalar_t v = static_cast<scalar_t>(sum);
      if (guard && v == scalar_t(0)) v = std::numeric_limits<scalar_t>::min();
      p[e] = v;
      m[e] = true;
    }
  }

  // Gate weights of token row t (in dense mode also its flags and dense row); counts its
  // slots into h[E] (h == nullptr: no plan).
  void gate_row(int64_t t, int32_t* h, Scratch& w) const {
    const scalar_t* x = X + t * E;
    w.stats = false;
    const bool selected = resolve_row(t, w);
    const int32_t* idx = I32 + t * K;
    if (AGREE) agreement_row(t, idx, selected, w);
    acc_t* z = w.z.data();
    char* valid = w.valid.data();
    int nvalid = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[k];
      valid[k] = e >= 0;
      z[k] = valid[k] ? static_cast<acc_t>(x[e]) : acc_t(0);
      if (valid[k]) {
        ++nvalid;
        if (h) ++h[e];
      }
    }
    // Each slot's numerator (exp(z - m), or the element-wise score) is computed once and
    // kept in z: the same values, sums and divisions as replay_math's gate_weight, with
    // half the exp calls.
    acc_t m = acc_t(0), s = acc_t(0);
    switch (sf) {
      case rm::kSoftmax: {
        if (normalize) {  // softmax over the valid selected logits (selected_softmax_stats)
          bool any = false;
          for (int64_t k = 0; k < K; ++k) {
            if (!valid[k]) continue;
            m = any ? rm::ro_max(m, z[k]) : z[k];
            any = true;
          }
          m = rm::max_or_zero(m, any);
          for (int64_t k = 0; k < K; ++k)
            if (valid[k]) {
              z[k] = rm::ro_exp(z[k] - m);
              s += z[k];
            }
        } else {
          row_stats(x, w);
          m = w.m;
          s = w.s;
          for (int64_t k = 0; k < K; ++k)
            if (valid[k]) z[k] = rm::ro_exp(z[k] - m);
        }
        const acc_t sd = s == acc_t(0) ? acc_t(1) : s;  // a NaN sum stays NaN
        for (int64_t k = 0; k < K; ++k) z[k] = valid[k] ? rm::ro_div(z[k], sd) * scale : acc_t(0);
        break;
      }
      case rm::kSigmoid:
      case rm::kSqrtsoftplus: {
        for (int64_t k = 0; k < K; ++k)
          if (valid[k]) z[k] = rm::score(sf, z[k]);
        const bool divide = rm::divides_by_sum(normalize, nvalid);
        if (divide)
          for (int64_t k = 0; k < K; ++k)
            if (valid[k]) s += z[k];
        for (int64_t k = 0; k < K; ++k)
          z[k] = valid[k] ? (divide ? rm::ro_div(z[k], s + acc_t(rm::kNormEps)) : z[k]) * scale
                          : acc_t(0);
        break;
      }
      default: TORCH_CHECK(false, "replay_ops native gate: unknown score function id ", sf);
    }
    if (P) {
      write_dense_row(t, z);
    } else if (WA) {
      for (int64_t k = 0; k < K; ++k) WA[t * K + k] = z[k];
    } else {
      for (int64_t k = 0; k < K; ++k) W[t * K + k] = static_cast<scalar_t>(z[k]);
    }
  }

  // Phase 1 for chunk c: weights, indices and the chunk's slot count per expert.
  void hist_chunk(int64_t c, Scratch& w) {
    int32_t* h = hist.data() + c * E;
    const int64_t t_end = std::min(T, (c + 1) * tok_per_chunk);
    for (int64_t t = c * tok_per_chunk; t < t_end; ++t) gate_row(t, h, w);
  }

  // Phase 2: hist[c][e] becomes the first row of chunk c within expert e's segment (before
  // the expert's offset); the counts, the aligned offsets, and -1 in padding and tail.
  void scan_chunks() {
    std::vector<int64_t> running(static_cast<size_t>(E), 0);
    for (int64_t c = 0; c < nch; ++c) {
      int32_t* h = hist.data() + c * E;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t v = h[e];
        h[e] = static_cast<int32_t>(running[e]);
        running[e] += v;
      }
    }
    int64_t off = 0;
    OFF[0] = 0;
    for (int64_t e = 0; e < E; ++e) {
      CNT[e] = static_cast<int32_t>(running[e]);
      const int64_t seg_end = off + rm::padded_count(running[e], align);
      for (int64_t r = off + running[e]; r < seg_end; ++r) SS[r] = -1;  // padding rows
      off = seg_end;
      OFF[e + 1] = static_cast<int32_t>(off);
    }
    for (int64_t r = off; r < n_sorted; ++r) SS[r] = -1;  // tail past the used rows
  }

  // Phase 3 for chunk c: its slots take their rows in ascending flat-slot order.
  void scatter_chunk(int64_t c, int32_t* cursor) const {
    const int32_t* h = hist.data() + c * E;
    for (int64_t e = 0; e < E; ++e) cursor[e] = OFF[e] + h[e];
    const int64_t s_end = std::min(T, (c + 1) * tok_per_chunk) * K;
    for (int64_t s = c * tok_per_chunk * K; s < s_end; ++s) {
      const int32_t e = I32[s];
      if (e >= 0) {
        const int32_t r = cursor[e]++;
        RID[s] = r;
        SS[r] = static_cast<int32_t>(s);
      } else {
        RID[s] = -1;
      }
    }
  }

  void run() {
    if (!with_plan) {  // dense rows only: each chunk's rows, no histograms
      at::parallel_for(0, nch, 1, [&](int64_t c0, int64_t c1) {
        Scratch w = scratch();
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t t_end = std::min(T, (c + 1) * tok_per_chunk);
          for (int64_t t = c * tok_per_chunk; t < t_end; ++t) gate_row(t, nullptr, w);
        }
      });
      return;
    }
    at::parallel_for(0, nch, 1, [&](int64_t c0, int64_t c1) {
      Scratch w = scratch();
      for (int64_t c = c0; c < c1; ++c) hist_chunk(c, w);
    });
    scan_chunks();
    at::parallel_for(0, nch, 1, [&](int64_t c0, int64_t c1) {
      std::vector<int32_t> cursor(static_cast<size_t>(E));
      for (int64_t c = c0; c < c1; ++c) scatter_chunk(c, cursor.data());
    });
  }
};

// The sizes, options and inputs of a gate call (the selection's too); the outputs are set
// by the caller.
template <typename scalar_t, typename index_t>
void gate_setup(GateFwd<scalar_t, index_t>& g, const at::Tensor& logits, const at::Tensor& idx,
                int sf, bool normalize, double scaling, int64_t align, int64_t n_sorted,
                const replay_native::GateSelection& s) {
  using acc_t = acc_type_t<scalar_t>;
  g.X = logits.data_ptr<scalar_t>();
  g.I = idx.data_ptr<index_t>();
  g.st = idx.stride(0);
  g.sk = idx.stride(1);
  g.T = logits.size(0);
  g.E = logits.size(1);
  g.K = idx.size(1);
  g.align = align;
  g.n_sorted = n_sorted;
  g.sf = sf;
  g.normalize = normalize;
  g.scale = static_cast<acc_t>(scaling);
  g.rk = row_kernels<scalar_t>();
  g.tok_per_chunk = std::max<int64_t>(1, kSlotsPerChunk / g.K);
  g.nch = num_chunks(g.T, g.tok_per_chunk);
  g.MASK = s.mask.defined() ? s.mask.data_ptr<bool>() : nullptr;
  g.padding = s.padding;
  g.sel = s.params;
  g.BIAS = s.bias.defined() ? s.bias.data_ptr<acc_t>() : nullptr;
}

// The agreement outputs of a gate call: [T] when asked for, else [0] (not written).
template <typename scalar_t, typename index_t>
void agreement_outputs(GateFwd<scalar_t, index_t>& g, at::Tensor& agreement,
                       at::Tensor& set_logprob) {
  if (agreement.numel() == 0) return;
  g.AGREE = agreement.data_ptr<bool>();
  g.LP = set_logprob.data_ptr<acc_type_t<scalar_t>>();
}

template <typename scalar_t, typename index_t>
void gate_fwd_impl(const at::Tensor& logits, const at::Tensor& idx, int sf, bool normalize,
                   double scaling, int64_t align, const replay_native::GateSelection& sel,
                   replay_native::GateOutputs& o) {
  GateFwd<scalar_t, index_t> g;
  gate_setup(g, logits, idx, sf, normalize, scaling, align, o.sorted_slots.numel(), sel);
  if (o.weights.scalar_type() == logits.scalar_type())
    g.W = o.weights.data_ptr<scalar_t>();
  else  // weights_acc: the weights in the compute type, unrounded
    g.WA = o.weights.data_ptr<acc_type_t<scalar_t>>();
  g.I32 = o.idx32.data_ptr<int32_t>();
  g.CNT = o.counts.data_ptr<int32_t>();
  g.OFF = o.offsets.data_ptr<int32_t>();
  g.RID = o.row_id_map.data_ptr<int32_t>();
  g.SS = o.sorted_slots.data_ptr<int32_t>();
  agreement_outputs(g, o.agreement, o.set_logprob);
  g.hist.assign(static_cast<size_t>(g.nch * g.E), 0);
  g.run();
}

// The options of the dense mode beyond those of the gate.
struct DenseOpts {
  const int64_t* fallback;
  int64_t ep, offset_mod;
  bool guard, with_plan;
};

template <typename scalar_t, typename index_t>
void gate_dense_impl(const at::Tensor& logits, const at::Tensor& idx, int sf, bool normalize,
                     double scaling, int64_t align, const DenseOpts& d,
                     const replay_native::GateSelection& sel,
                     replay_native::DenseGateOutputs& o) {
  GateFwd<scalar_t, index_t> g;
  gate_setup(g, logits, idx, sf, normalize, scaling, align, o.sorted_slots.numel(), sel);
  g.P = o.probs.data_ptr<scalar_t>();
  g.MAP = o.routing_map.data_ptr<bool>();
  g.FLAGS = o.row_flags.data_ptr<uint8_t>();
  g.FB = d.fallback;
  g.ep = d.ep;
  g.offset_mod = d.offset_mod;
  g.guard = d.guard;
  g.with_plan = d.with_plan;
  g.I32 = o.idx32.data_ptr<int32_t>();
  if (d.with_plan) {
    g.CNT = o.counts.data_ptr<int32_t>();
    g.OFF = o.offsets.data_ptr<int32_t>();
    g.RID = o.row_id_map.data_ptr<int32_t>();
    g.SS = o.sorted_slots.data_ptr<int32_t>();
    g.hist.assign(static_cast<size_t>(g.nch * g.E), 0);
  }
  agreement_outputs(g, o.agreement, o.set_logprob);
  g.run();
}

// Adds the gradient of g * set_logprob of row x (replay_select.h) to row[0..E): the set is
// the row's distinct used experts `ids` (K entries; -1, and any id outside [0, E), is no
// expert, as in the weights' gradient and the other backends). `member` is scratch [E].
template <typename scalar_t, typename acc_t>
void add_set_logprob_grad(const RowKernels<scalar_t>& rk, int sf, const scalar_t* x,
                          const int32_t* ids, int64_t E, int64_t K, acc_t g, acc_t* row,
                          char* member) {
  std::vector<int32_t> used(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) used[k] = rm::takes_row(ids[k], E) ? ids[k] : -1;
  const int32_t* idx = used.data();
  std::vector<acc_t> z(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) z[k] = idx[k] >= 0 ? static_cast<acc_t>(x[idx[k]]) : acc_t(0);
  if (sf == rm::kSoftmax) {
    const acc_t lse_s = rm::member_logsumexp(z.data(), idx, K);
    if (lse_s == rm::neg_inf<acc_t>()) return;  // an empty set: -inf, gradient 0
    acc_t m, s;
    rk.softmax_stats(x, E, m, s);
    for (int64_t j = 0; j < E; ++j)
      row[j] -= g * (rm::ro_exp(static_cast<acc_t>(x[j]) - m) / s);
    for (int64_t k = 0; k < K; ++k)
      if (rm::first_of_expert(idx, k)) row[idx[k]] += g * rm::ro_exp(z[k] - lse_s);
    return;
  }
  if (sf != rm::kSigmoid && sf != rm::kSqrtsoftplus)
    TORCH_CHECK(false, "replay_ops native gate_backward: unknown score function id ", sf);
  acc_t mass = acc_t(0), total = acc_t(0);
  for (int64_t k = 0; k < K; ++k)
    if (rm::first_of_expert(idx, k)) mass += rm::score(sf, z[k]);
  if (!(mass > acc_t(0))) return;  // a mass of 0: -inf, gradient 0
  for (int64_t j = 0; j < E; ++j) total += rm::score(sf, static_cast<acc_t>(x[j]));
  std::fill(member, member + E, 0);
  for (int64_t k = 0; k < K; ++k)
    if (idx[k] >= 0) member[idx[k]] = 1;
  const acc_t inv_mass = acc_t(1) / mass, inv_total = acc_t(1) / total;
  for (int64_t j = 0; j < E; ++j) {
    const acc_t xj = static_cast<acc_t>(x[j]);
    const acc_t d = rm::score_grad(sf, xj, rm::score(sf, xj));
    row[j] += g * d * ((member[j] ? inv_mass : acc_t(0)) - inv_total);
  }
}

// The gate backward. `grad_at(t, k, e)` is the gradient of slot k of row t (routed to
// expert e >= 0) in the compute type: the [T, K] weight gradient, or the dense probs
// gradient at column e.
template <typename scalar_t, typename GradAt>
void gate_bwd_impl(GradAt grad_at, const at::Tensor& logits, const at::Tensor& idx32, int sf,
                   bool normalize, double scaling, const at::Tensor& grad_lp, at::Tensor& grad) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t T = logits.size(0), E = logits.size(1), K = idx32.size(1);
  const scalar_t* X = logits.data_ptr<scalar_t>();
  const int32_t* I = idx32.data_ptr<int32_t>();
  scalar_t* GR = grad.data_ptr<scalar_t>();
  const acc_t scale = static_cast<acc_t>(scaling);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(E, 1));
  const RowKernels<scalar_t> rk = row_kernels<scalar_t>();
  // the gradient of set_logprob [T] (compute type), or nullptr
  const acc_t* GLP = grad_lp.defined() ? grad_lp.data_ptr<acc_t>() : nullptr;

  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    std::vector<acc_t> row(static_cast<size_t>(E));
    std::vector<acc_t> z(static_cast<size_t>(K)), g(static_cast<size_t>(K));
    std::vector<char> valid(static_cast<size_t>(K));
    std::vector<char> member(GLP ? static_cast<size_t>(E) : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const scalar_t* x = X + t * E;
      int nvalid = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = I[t * K + k];
        valid[k] = rm::takes_row(e, E);
        z[k] = valid[k] ? static_cast<acc_t>(x[e]) : acc_t(0);
        g[k] = valid[k] ? static_cast<acc_t>(grad_at(t, k, e)) * scale : acc_t(0);
        nvalid += valid[k] ? 1 : 0;
      }
      if (sf == rm::kSoftmax && !normalize) {
        acc_t m, s;
        rk.softmax_stats(x, E, m, s);
        acc_t A = acc_t(0);
        for (int64_t k = 0; k < K; ++k) {
          const acc_t a = valid[k] ? g[k] * (rm::ro_exp(z[k] - m) / s) : acc_t(0);
          z[k] = a;  // reuse: a_k
          A += a;
        }
        rk.softmax_full_base(x, E, m, s, A, row.data());
        for (int64_t k = 0; k < K; ++k)
          if (valid[k]) row[I[t * K + k]] += z[k];
      } else {
        std::fill(row.begin(), row.end(), acc_t(0));
        if (sf == rm::kSoftmax) {  // normalize=True: softmax over the selected logits
          acc_t m, s;
          rm::selected_softmax_stats(z.data(), valid.data(), K, m, s);
          const acc_t sd = s == acc_t(0) ? acc_t(1) : s;
          acc_t Gs = acc_t(0);
          for (int64_t k = 0; k < K; ++k)
            if (valid[k]) Gs += g[k] * (rm::ro_exp(z[k] - m) / sd);
          for (int64_t k = 0; k < K; ++k)
            if (valid[k])
              row[I[t * K + k]] += rm::softmax_sel_dz(rm::ro_exp(z[k] - m) / sd, g[k], Gs);
        } else if (sf == rm::kSigmoid || sf == rm::kSqrtsoftplus) {
          acc_t S = acc_t(0), D = acc_t(0);
          for (int64_t k = 0; k < K; ++k) {
            if (!valid[k]) continue;
            const acc_t sc = rm::score(sf, z[k]);
            S += sc;
            D += g[k] * sc;
          }
          S += acc_t(rm::kNormEps);
          for (int64_t k = 0; k < K; ++k)
            if (valid[k])
              row[I[t * K + k]] += rm::elementwise_dz(sf, normalize, nvalid, z[k], g[k], S, D);
        } else {
          TORCH_CHECK(false, "replay_ops native gate_backward: unknown score function id ", sf);
        }
      }
      if (GLP && GLP[t] != acc_t(0))
        add_set_logprob_grad(rk, sf, x, I + t * K, E, K, GLP[t], row.data(), member.data());
      scalar_t* out = GR + t * E;
      for (int64_t j = 0; j < E; ++j) out[j] = static_cast<scalar_t>(row[j]);
    }
  });
}

}  // namespace

replay_native::GateFwdResult gate_fwd(
    const at::Tensor& logits_in, const at::Tensor& expert_indices,
    const c10::optional<at::Tensor>& replay_mask, const c10::optional<at::Tensor>& expert_bias,
    int64_t score_func, bool normalize, double scaling_factor, int64_t align, int64_t padding,
    int64_t selection_source, bool round_scores, int64_t num_groups, int64_t group_topk,
    int64_t group_topn, bool agreement, bool weights_acc) {
  const c10::Device cpu(c10::kCPU);
  replay_native::check_gate_fwd(logits_in, expert_indices, cpu);
  const int sf = replay_native::checked_score_func(score_func);
  const at::Tensor logits = logits_in.contiguous();
  const replay_native::GateSelection sel = replay_native::checked_gate_selection(
      "gate", logits, expert_indices.size(1), sf, replay_mask, padding, expert_bias,
      selection_source, round_scores, num_groups, group_topk, group_topn, false, cpu);
  replay_native::GateOutputs o(logits, expert_indices.size(1), align, agreement, weights_acc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(),
                                  "replay_native_gate_fwd", [&] {
    dispatch_index(expert_indices, "expert_indices", [&](auto index_tag) {
      using index_t = decltype(index_tag);
      gate_fwd_impl<scalar_t, index_t>(logits, expert_indices, sf, normalize, scaling_factor,
                                       align, sel, o);
    });
  });
  return o.tuple();
}

at::Tensor gate_bwd(const at::Tensor& grad_weights, const at::Tensor& logits_in,
                    const at::Tensor& expert_indices,
                    const c10::optional<at::Tensor>& grad_set_logprob, int64_t score_func,
                    bool normalize, double scaling_factor) {
  const c10::Device cpu(c10::kCPU);
  replay_native::check_gate_bwd(grad_weights, logits_in, expert_indices, cpu);
  const int sf = replay_native::checked_score_func(score_func);
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor idx32 = expert_indices.contiguous();
  const auto acc_dtype = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor g_acc = grad_weights.to(acc_dtype).contiguous();
  const at::Tensor glp = replay_native::checked_set_logprob_grad(grad_set_logprob, logits, cpu);
  at::Tensor grad = at::empty_like(logits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(),
                                  "replay_native_gate_bwd", [&] {
    using acc_t = acc_type_t<scalar_t>;
    const acc_t* G = g_acc.data_ptr<acc_t>();
    const int64_t K = idx32.size(1);
    gate_bwd_impl<scalar_t>([G, K](int64_t t, int64_t k, int32_t) { return G[t * K + k]; },
                            logits, idx32, sf, normalize, scaling_factor, glp, grad);
  });
  return grad;
}

replay_native::GateDenseFwdResult gate_dense_fwd(
    const at::Tensor& logits_in, const at::Tensor& expert_indices,
    const c10::optional<at::Tensor>& replay_mask, const c10::optional<at::Tensor>& fallback,
    const c10::optional<at::Tensor>& expert_bias, int64_t score_func, bool normalize,
    double scaling_factor, int64_t padding, int64_t ep_size, int64_t spread_offset,
    bool underflow_guard, int64_t align, bool with_plan, int64_t selection_source,
    bool round_scores, int64_t num_groups, int64_t group_topk, int64_t group_topn,
    bool agreement) {
  const c10::Device cpu(c10::kCPU);
  replay_native::check_gate_dense_fwd(logits_in, expert_indices, replay_mask, fallback, padding,
                                      ep_size, spread_offset, cpu);
  const int sf = replay_native::checked_score_func(score_func);
  const at::Tensor logits = logits_in.contiguous();
  const replay_native::GateSelection sel = replay_native::checked_gate_selection(
      "gate_dense", logits, expert_indices.size(1), sf, replay_mask, padding, expert_bias,
      selection_source, round_scores, num_groups, group_topk, group_topn, true, cpu);
  const at::Tensor fb = fallback ? fallback->to(at::kLong).contiguous() : at::Tensor();
  replay_native::DenseGateOutputs o(logits, expert_indices.size(1), align, with_plan, agreement);
  const DenseOpts d{fb.defined() ? fb.data_ptr<int64_t>() : nullptr, ep_size,
                    logits.size(1) ? spread_offset % logits.size(1) : 0, underflow_guard,
                    with_plan};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(),
                                  "replay_native_gate_dense_fwd", [&] {
    dispatch_index(expert_indices, "expert_indices", [&](auto index_tag) {
      using index_t = decltype(index_tag);
      gate_dense_impl<scalar_t, index_t>(logits, expert_indices, sf, normalize, scaling_factor,
                                         align, d, sel, o);
    });
  });
  return o.tuple();
}

at::Tensor gate_dense_bwd(const at::Tensor& grad_probs, const at::Tensor& logits_in,
                          const at::Tensor& expert_indices,
                          const c10::optional<at::Tensor>& grad_set_logprob,
                          int64_t score_func, bool normalize, double scaling_factor) {
  const c10::Device cpu(c10::kCPU);
  replay_native::check_gate_dense_bwd(grad_probs, logits_in, expert_indices, cpu);
  const int sf = replay_native::checked_score_func(score_func);
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor idx32 = expert_indices.contiguous();
  const at::Tensor glp = replay_native::checked_set_logprob_grad(grad_set_logprob, logits, cpu);
  at::Tensor grad = at::empty_like(logits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(),
                                  "replay_native_gate_dense_bwd", [&] {
    // read in place, any strides (an expanded or transposed gradient is not copied)
    const scalar_t* G = grad_probs.data_ptr<scalar_t>();
    const int64_t sgt = grad_probs.stride(0), sge = grad_probs.stride(1);
    gate_bwd_impl<scalar_t>(
        [G, sgt, sge](int64_t t, int64_t, int32_t e) { return G[t * sgt + e * sge]; }, logits,
        idx32, sf, normalize, scaling_factor, glp, grad);
  });
  return grad;
}

// Each op's name is one function here, of its signature in native_ops.inc.
REPLAY_NATIVE_OPS(REPLAY_NATIVE_CHECK_ONE)

}  // namespace replay_cpu
