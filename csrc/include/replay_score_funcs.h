// Generated from replay_ops/scores.py by `make score-header`;
// do not edit. tests/test_scores.py checks that it matches the table.
#pragma once

namespace replay_math {

enum ScoreFunc : int {
  kSoftmax = 0,
  kSigmoid = 1,
  kSqrtsoftplus = 2,
};

constexpr int kNumScoreFuncs = 3;

// The name of a score function id (nullptr for an unknown id).
inline const char* score_func_name(int id) {
  switch (id) {
    case 0: return "softmax";
    case 1: return "sigmoid";
    case 2: return "sqrtsoftplus";
    default: return nullptr;
  }
}

}  // namespace replay_math
