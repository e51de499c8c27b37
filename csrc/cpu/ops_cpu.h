// Declarations of the CPU kernels of the internal replay_native::* ops (their signatures
// are written once, in ../bindings/native_ops.inc).
#pragma once

#include "../bindings/native_ops.h"

namespace replay_cpu {

#include "../bindings/native_ops.inc"

}  // namespace replay_cpu
