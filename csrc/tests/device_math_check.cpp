// The gate's device arithmetic on the CPU: compiled with -DRO_EMULATE_DEVICE_MATH, the
// functions of replay_math.h take their device branches (reciprocal estimates refined with
// FMA steps, device_math_emulation.h standing in for the intrinsics), and this program runs
// them in the order the CUDA kernels do (gate_row in csrc/cuda/gate_kernels.cu, and its
// backward kernel), with the warp reductions as plain sums in lane order.
// tests/test_device_math.py builds it, feeds it rows of extreme logits and compares the
// results with the fp64 reference.
//
// Input, one row per line: dtype(32|64) score_func normalize scale E K  x[E]  idx[K]  g[K]
// Output, one line per row: the K weights, then the E values of the logits gradient.
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "replay_math.h"

namespace rm = replay_math;

template <typename A>
void row(int sf, bool normalize, A scale, const std::vector<A>& x, const std::vector<int>& idx,
         const std::vector<A>& gw) {
  const int E = static_cast<int>(x.size()), K = static_cast<int>(idx.size());
  const bool full = sf == rm::kSoftmax && !normalize;
  auto valid = [&](int k) { return rm::takes_row(idx[k], E); };
  // ---- forward (gate_row)
  int nvalid = 0;
  bool any = false;
  A m = A(0), s = A(0);
  for (int k = 0; k < K; ++k) {
    if (!valid(k)) continue;
    ++nvalid;
    const A z = x[idx[k]];
    if (sf == rm::kSoftmax) {
      if (!full) {
        m = any ? rm::ro_max(m, z) : z;
        any = true;
      }
    } else if (rm::divides_by_sum(normalize, 2)) {
      s += rm::score(sf, z);
    }
  }
  if (full) {
    m = x[0];
    for (int j = 1; j < E; ++j) m = rm::ro_max(m, x[j]);
    for (int j = 0; j < E; ++j) s += rm::ro_exp(x[j] - m);
  } else if (sf == rm::kSoftmax) {
    m = rm::max_or_zero(m, any);
    for (int k = 0; k < K; ++k)
      if (valid(k)) s += rm::ro_exp(x[idx[k]] - m);
  }
  std::ostringstream out;
  out.precision(17);
  for (int k = 0; k < K; ++k)
    out << (valid(k) ? rm::gate_weight(sf, normalize, x[idx[k]], m, s, nvalid, scale) : A(0))
        << ' ';
  // ---- backward (one warp per row: lane k holds slot k)
  std::vector<A> z(K, A(0)), g(K, A(0)), dz(K, A(0)), grad(E, A(0));
  for (int k = 0; k < K; ++k)
    if (valid(k)) z[k] = x[idx[k]], g[k] = gw[k] * scale;
  A Asum = A(0);
  if (full) {
    A bm = -A(INFINITY), bs = A(0);
    for (int j = 0; j < E; ++j) bm = rm::ro_max(bm, x[j]);
    for (int j = 0; j < E; ++j) bs += rm::ro_exp(x[j] - bm);
    m = bm, s = bs;
    for (int k = 0; k < K; ++k)
      if (valid(k)) dz[k] = g[k] * rm::ro_div(rm::ro_exp(z[k] - m), s), Asum += dz[k];
    for (int j = 0; j < E; ++j) grad[j] = rm::softmax_full_base(rm::ro_exp(x[j] - m), s, Asum);
  } else if (sf == rm::kSoftmax) {
    A mm = -A(INFINITY);
    for (int k = 0; k < K; ++k)
      if (valid(k)) mm = rm::ro_max(mm, z[k]);
    m = rm::max_or_zero(mm, nvalid > 0);
    A ssum = A(0), Gs = A(0);
    std::vector<A> q(K, A(0));
    for (int k = 0; k < K; ++k)
      if (valid(k)) ssum += rm::ro_exp(z[k] - m);
    for (int k = 0; k < K; ++k)
      if (valid(k)) q[k] = rm::ro_div(rm::ro_exp(z[k] - m), ssum == A(0) ? A(1) : ssum);
    for (int k = 0; k < K; ++k) Gs += valid(k) ? g[k] * q[k] : A(0);
    for (int k = 0; k < K; ++k)
      if (valid(k)) dz[k] = rm::softmax_sel_dz(q[k], g[k], Gs);
  } else {
    A S = A(0), D = A(0);
    for (int k = 0; k < K; ++k)
      if (valid(k)) S += rm::score(sf, z[k]), D += g[k] * rm::score(sf, z[k]);
    S += A(rm::kNormEps);
    for (int k = 0; k < K; ++k)
      if (valid(k)) dz[k] = rm::elementwise_dz(sf, normalize, nvalid, z[k], g[k], S, D);
  }
  for (int k = 0; k < K; ++k)  // column of a selected slot: base + slot gradients, k order
    if (valid(k)) grad[idx[k]] += dz[k];
  for (int j = 0; j < E; ++j) out << grad[j] << ' ';
  std::cout << out.str() << '\n';
}

// One number, "inf", "-inf" and "nan" included (operator>> does not read them).
double read_number(std::istringstream& in) {
  std::string tok;
  in >> tok;
  return std::strtod(tok.c_str(), nullptr);
}

template <typename A>
void parse_and_run(std::istringstream& in, int sf, bool normalize, double scale, int E, int K) {
  std::vector<A> x(E), g(K);
  std::vector<int> idx(K);
  for (auto& v : x) v = static_cast<A>(read_number(in));
  for (auto& v : idx) in >> v;
  for (auto& v : g) v = static_cast<A>(read_number(in));
  row<A>(sf, normalize, static_cast<A>(scale), x, idx, g);
}

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    int bits, sf, normalize, E, K;
    double scale;
    if (!(in >> bits >> sf >> normalize >> scale >> E >> K)) continue;
    if (bits == 32)
      parse_and_run<float>(in, sf, normalize != 0, scale, E, K);
    else
      parse_and_run<double>(in, sf, normalize != 0, scale, E, K);
  }
  return 0;
}
