// Row kernels of the CPU gate: the softmax statistics (max and sum of exp) of a row of all
// E logits, and the dense softmax gradient base of such a row. They dominate the gate with
// softmax and normalize=False, so they are compiled once per x86 vector ISA (baseline,
// AVX2, AVX-512) and the best one the CPU supports is picked at run time.
//
// Every ISA variant gives bitwise the same result: the source fixes the order of every
// operation (kRowLanes interleaved partial sums combined in a fixed tree), the build turns
// off FP contraction (-ffp-contract=off, so no variant fuses a multiply-add), and IEEE
// add/mul/compare are exact per lane whatever the vector width. tests/test_native.py
// checks this on every ISA the machine has.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <string>

namespace replay_cpu {

enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// The ISA the row kernels use now (the best supported one unless capped, see below).
CpuIsa active_cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

// replay_native::cpu_isa(str name) -> str. With name "" it returns the active ISA; with
// "baseline", "avx2" or "avx512" it makes that ISA active (it must be supported) and
// returns the previous one. The environment variable REPLAY_OPS_CPU_ISA (same names) caps
// the initial choice: the active ISA is the lower of it and the best supported one.
std::string cpu_isa(c10::string_view name);

template <typename scalar_t>
using row_acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Per-row kernels of one ISA for one logits dtype.
template <typename scalar_t>
struct RowKernels {
  using acc_t = row_acc_t<scalar_t>;
  // m = max_j x_j, s = sum_j exp(x_j - m) over a row of E >= 1 logits.
  void (*softmax_stats)(const scalar_t* x, int64_t E, acc_t& m, acc_t& s);
  // row_j = -(exp(x_j - m) / s) * A for j < E (softmax_full_base of replay_math.h).
  void (*softmax_full_base)(const scalar_t* x, int64_t E, acc_t m, acc_t s, acc_t A,
                            acc_t* row);
};

// The kernels of the active ISA (fp64 rows always use the exact library exp).
template <typename scalar_t>
RowKernels<scalar_t> row_kernels();

}  // namespace replay_cpu
