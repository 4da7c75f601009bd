// Warp emulator: the CUDA math constants the kernels use.
#pragma once
#define CUDART_INF_F __builtin_inff()
#define CUDART_NAN_F __builtin_nanf("")
