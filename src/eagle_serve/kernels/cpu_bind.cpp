// The Python module of the CPU kernels. Compile time is most of `make setup`'s and of a fresh
// `make test`'s kernel build, and headers are most of it: <torch/extension.h> (the whole C++
// API) costs ~20 s a file, <torch/types.h> (all of ATen's ops) ~7 s. So this file includes only
// torch's pybind11 glue (Tensor, optional and vector casters), and the kernels' files only
// ATen's Tensor (cpu.h), whose methods (new_empty, add, ...) are all the ops they call.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q and k, k and v written to their cache slots");
  m.def("rms_norm", &rms_norm, "row-wise fp32 RMSNorm (AVX2 + FMA)");
  m.def("linear", &linear, "row-invariant fp32 linear (AVX2 + FMA)");
  m.attr("max_block_rows") = kMaxBlockRows;
  m.def("linear_q4_1", &linear_q4_1, "the fp32 linear of a Q4_1 weight, bitwise `linear`'s");
  m.def("linear_q8_0", &linear_q8_0, "the fp32 linear of a Q8_0 weight, bitwise `linear`'s");
  m.def("linear_i8", &linear_i8, "a Q4_1/Q8_0 linear on 8-bit activations (cpu_i8.cpp)");
  m.attr("i8_vnni") = kI8Vnni;
  m.def("screen_i8", &screen_i8, "the tokens a screened LM head keeps (cpu_i8.cpp)");
  m.def("linear_q4_1_amx", &linear_q4_1_amx, "a Q4_1 linear in fp32 on AMX tiles (cpu_amx.cpp)");
  m.attr("amx") = kAmx;
  m.def("attend", &attend, "row-invariant attention of each query over its own key slots");
  m.def("decoder_stack", &decoder_stack, "a Llama-like layer stack in one call (cpu_stack.cpp)");
  m.def("keyed_uniforms", &keyed_uniforms, "each key's uniforms (cpu_random.cpp)");
  m.def("race", &race, "each row's exponential race with its key's noise (cpu_random.cpp)");
  m.def("corpus_walk", &corpus_walk, "the corpus lookup's walk (cpu_lookup.cpp)");
}
