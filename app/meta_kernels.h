// Meta-device kernels for the ATen ops the model's forward and backward use that LibTorch
// registers no C++ meta kernel for (PyTorch keeps theirs in Python). Only shapes and dtypes:
// `titan-train estimate` runs the model on meta tensors to count its activation bytes.
#pragma once

namespace titan {

// Registers the kernels once; later calls do nothing.
void register_meta_kernels();

}  // namespace titan
