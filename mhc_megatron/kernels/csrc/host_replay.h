// The replay of a recorded op call (host_replay.cpp), shared with the ops' autograd nodes
// (autograd_nodes.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace mhc {

// Allocate and launch as recipe `id` records, on `stream` (a cudaStream_t) of CUDA device
// `device`; returns the tensors the recorded call returned.
std::vector<at::Tensor> replay(int64_t id, const std::vector<at::Tensor>& inputs,
                               const std::vector<at::Tensor>& scratch, void* stream,
                               int64_t device);

// Whether `stream` (of CUDA device `device`) is capturing a CUDA graph.
bool capturing(void* stream, int64_t device);

// The current CUDA stream of `device` (a cudaStream_t), as torch.cuda.current_stream gives it.
void* current_stream(int64_t device);

// Binds the autograd nodes' functions and types (autograd_nodes.cpp).
void bind_autograd_nodes(pybind11::module& m);

// Binds the saved-tensor hooks of mhc_recompute's blocks (saved_ranges.cpp).
void bind_saved_ranges(pybind11::module& m);

}  // namespace mhc
