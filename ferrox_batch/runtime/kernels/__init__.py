"""The C kernels for the CPU (`csrc/`): built once per process (`kernel_build`), called through typed, checked
entry points (`cpu_kernels`), with the fp16 weight panels they read (`packed_gemm`) and the OpenMP pool they
share (`openmp`)."""
