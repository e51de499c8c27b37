// The model's own selection of one token row (replay_ops.Selection), the agreement test and
// the replayed set's log-probability: framework-free math shared by the C++ CPU kernels and
// (written for `__host__ __device__`, like replay_math.h) the CUDA kernels.
//
// Selection of row t (docs/ops.md, "The model's own selection"). The caller supplies the
// selection value v_j of every expert j through `value(j)`:
//   u_j = x_j (source kSelectLogits) or the score of x_j (softmax over all E, sigmoid,
//         sqrt-softplus; in the compute type), rounded to the logits dtype when asked;
//   v_j = u_j + expert_bias[j] (when there is a bias), in the compute type.
// Then, with the rank order `ranks_before` (larger first; NaN larger than every number;
// among equal values the lower id first, for experts and for groups alike):
//   no groups: the K first experts in rank order;
//   groups (num_groups G > 0): E = G * size; the score of group g is the sum of its n
//     first values in rank order, added in that order (n = group_topn, resolved by the
//     caller: group_score_topn, or K / group_topk); the group_topk first groups in rank
//     order are kept; the K first experts of the kept groups in rank order.
// The result lists the K experts in rank order (descending value).
//
// Where v is an increasing function of the logit (the scores without rounding, bias or
// groups: softmax, sigmoid and sqrt-softplus all increase), the ranking is the logits'
// ranking, and the callers rank the logits themselves (`ranks_logits`): no score is
// computed, and two logits whose scores round to the same float keep their order.
//
// Cost per row: one pass over the E values with one compare each, plus an insertion into
// a ranked list of K for the few that enter it (about K ln(E/K) on random rows); with
// groups two passes and O(G * group_topk); no sort, no memory but the caller's scratch.
#pragma once

#include <stdint.h>

#include "replay_math.h"

namespace replay_math {

// What the selection ranks (replay_ops.Selection.source, numbered as the native ops take
// it: replay_ops/backends/native.py SELECTION_SOURCES).
constexpr int kSelectScores = 0;  // the score function's scores
constexpr int kSelectLogits = 1;  // the raw logits (softmax only)

struct SelectionParams {
  int source;          // kSelectScores or kSelectLogits
  bool round_scores;   // u_j rounded to the logits dtype (applied by the caller's value(j))
  int64_t num_groups;  // 0: no group limit
  int64_t group_topk;  // groups kept (0 without groups)
  int64_t group_topn;  // values summed per group score (resolved, > 0 with groups)
};

// True when the selection values are the row's logits themselves (v_j = x_j): no bias, and
// the logits source (rounding the logits to their own dtype changes nothing), or the
// scores (increasing in the logit) without rounding or groups.
RO_HDI bool ranks_logits(const SelectionParams& p, bool has_bias) {
  return !has_bias &&
         (p.source == kSelectLogits || (!p.round_scores && p.num_groups <= 0));
}

// True when (a, ia) comes before (b, ib) in the selection's order.
template <typename acc_t>
RO_HDI bool ranks_before(acc_t a, int64_t ia, acc_t b, int64_t ib) {
  const bool na = a != a, nb = b != b;  // NaN
  if (na || nb) return na && (!nb || ia < ib);
  return a > b || (a == b && ia < ib);
}

// The best `cap` candidates so far, in rank order: vals/ids of length n. Candidates are
// offered in ascending id, so an equal value never displaces an entry (its id is larger):
// a candidate enters, and moves up past an entry, only when it `beats` it.
template <typename acc_t>
struct RankedList {
  acc_t* vals;
  int32_t* ids;
  int64_t cap;
  int64_t n = 0;

  RO_HDI RankedList(acc_t* v, int32_t* i, int64_t c) : vals(v), ids(i), cap(c) {}

  // v, offered after entry b, ranks before it: larger, or NaN over a number.
  RO_HDI static bool beats(acc_t v, acc_t b) { return v > b || (v != v && b == b); }

  // Whether v enters the list (the hot test, one compare once the list is full).
  RO_HDI bool enters(acc_t v) const { return n < cap || beats(v, vals[n - 1]); }

  // Insert v (which enters) at its rank; a full list drops its last entry.
  RO_HDI void insert(acc_t v, int32_t j) {
    int64_t p = n < cap ? n : cap - 1;
    while (p > 0 && beats(v, vals[p - 1])) {
      vals[p] = vals[p - 1];
      ids[p] = ids[p - 1];
      --p;
    }
    vals[p] = v;
    ids[p] = j;
    if (n < cap) ++n;
  }
};

// Offers the values of [j0, j1), in ascending id.
template <typename acc_t, typename ValueAt>
RO_HDI void offer_range(RankedList<acc_t>& list, const ValueAt& value, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const acc_t v = value(j);
    if (list.enters(v)) list.insert(v, static_cast<int32_t>(j));
  }
}

// The K experts the selection picks from a row of E values, into out[0..K) in rank order.
// Scratch: vals and ids of max(K, group_topn) entries; gvals and gids of group_topk entries
// (unused without groups). Needs K <= E, and with groups K <= group_topk * (E / G) and
// group_topn <= E / G (the callers check).
template <typename acc_t, typename ValueAt>
RO_HDI void select_row(const ValueAt& value, int64_t E, int64_t K, const SelectionParams& p,
                       int32_t* out, acc_t* vals, int32_t* ids, acc_t* gvals, int32_t* gids) {
  if (p.num_groups <= 0) {
    RankedList<acc_t> top(vals, out, K);
    offer_range(top, value, 0, E);
    return;
  }
  const int64_t G = p.num_groups, size = E / G;
  RankedList<acc_t> groups(gvals, gids, p.group_topk);
  for (int64_t g = 0; g < G; ++g) {
    RankedList<acc_t> best(vals, ids, p.group_topn);
    offer_range(best, value, g * size, (g + 1) * size);
    acc_t s = vals[0];
    for (int64_t i = 1; i < best.n; ++i) s += vals[i];  // the largest first
    if (groups.enters(s)) groups.insert(s, static_cast<int32_t>(g));
  }
  // the kept groups' experts, in ascending id
  RankedList<acc_t> top(vals, out, K);
  for (int64_t g = 0; g < G; ++g) {
    bool kept = false;
    for (int64_t i = 0; i < groups.n; ++i) kept = kept || gids[i] == g;
    if (!kept) continue;
    offer_range(top, value, g * size, (g + 1) * size);
  }
}

// The agreement of a row: its K used entries (-1 for an empty slot, possibly repeated) are
// the K distinct experts `sel` picked. Every one of the K distinct `sel` ids found among K
// used entries makes `used` a permutation of `sel` (no -1, no repeat). O(K^2).
RO_HDI bool same_set(const int32_t* used, const int32_t* sel, int64_t K) {
  for (int64_t k = 0; k < K; ++k) {
    bool found = false;
    for (int64_t j = 0; j < K && !found; ++j) found = used[j] == sel[k];
    if (!found) return false;
  }
  return true;
}

// The agreement of a row without groups, in one pass and no insertion: the K used entries
// are K distinct ids in [0, E), and no other expert ranks before the member that ranks last
// (exactly the K - 1 other members do). Equal to select_row + same_set without groups.
template <typename ValueAt>
RO_HDI bool is_top_set(const ValueAt& value, int64_t E, const int32_t* used, int64_t K) {
  for (int64_t k = 0; k < K; ++k) {
    if (used[k] < 0 || used[k] >= E) return false;
    for (int64_t j = 0; j < k; ++j)
      if (used[j] == used[k]) return false;
  }
  int32_t wi = used[0];  // the member that ranks last
  auto wv = value(wi);
  for (int64_t k = 1; k < K; ++k) {
    const auto v = value(used[k]);
    if (ranks_before(wv, wi, v, used[k])) {
      wv = v;
      wi = used[k];
    }
  }
  int64_t before = 0;
  if (wv != wv) {  // the last member is NaN: only NaNs of lower id rank before it
    for (int64_t j = 0; j < wi; ++j) before += value(j) != value(j) ? 1 : 0;
  } else {
    // NOTE: a lower id ranks before the last member when its value is not smaller (NaN
    // included), a higher id when it is larger (or NaN): two branch-free passes with a
    // 32-bit count, which the compiler vectorises (with a 64-bit count and one pass it did
    // not, and this pass was most of the agreement's cost).
    int32_t n = 0;
    const int32_t w = wi, e = static_cast<int32_t>(E);
    for (int32_t j = 0; j < w; ++j) n += !(value(j) < wv) ? 1 : 0;
    for (int32_t j = w; j < e; ++j) n += !(value(j) <= wv) ? 1 : 0;
    before = n;
  }
  return before == K - 1;
}

// True when slot k of a row is the first slot holding its expert (the set's members are
// the experts of these slots; -1 slots are not members).
RO_HDI bool first_of_expert(const int32_t* used, int64_t k) {
  if (used[k] < 0) return false;
  for (int64_t j = 0; j < k; ++j)
    if (used[j] == used[k]) return false;
  return true;
}

// ---------------------------------------------------------------------- set log-prob
// set_logprob of row t, the set S being the row's distinct used experts:
//   softmax:      logsumexp(x_S) - logsumexp(x) = (m_S + log s_S) - (m + log s), with
//                 m_S = max over S, s_S = sum over S of exp(x_e - m_S), (m, s) the row's
//                 softmax statistics over all E;
//   element-wise: log(sum over S of f(x_e)) - log(sum over all E of f(x_j)).
// An empty S, an m_S of -inf, or a mass of 0 gives -inf and a zero gradient.
// Gradient, for an upstream gradient g of set_logprob[t]:
//   softmax:      d/dx_j = g * ([j in S] exp(x_j - lse_S) - exp(x_j - m) / s)
//   element-wise: d/dx_j = g * f'(x_j) * ([j in S] / mass_S - 1 / mass_all)
template <typename acc_t>
RO_HDI acc_t neg_inf() {
  return -acc_t(INFINITY);
}

// lse_S of the values z over the members (first_of_expert); -inf when there is none.
template <typename acc_t>
RO_HDI acc_t member_logsumexp(const acc_t* z, const int32_t* used, int64_t K) {
  bool any = false;
  acc_t m = acc_t(0);
  for (int64_t k = 0; k < K; ++k) {
    if (!first_of_expert(used, k)) continue;
    m = any ? ro_max(m, z[k]) : z[k];
    any = true;
  }
  if (!any || m == neg_inf<acc_t>()) return neg_inf<acc_t>();
  acc_t s = acc_t(0);
  for (int64_t k = 0; k < K; ++k)
    if (first_of_expert(used, k)) s += ro_exp(z[k] - m);
  return m + log(s);
}

}  // namespace replay_math
