// The replay of a recorded op call (host_replay.cpp), shared with the ops' autograd nodes
// (autograd_nodes.cpp).
#pragma once

#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/extension.h>

#include <memory>
#include <vector>

namespace mhc {

// Allocate and launch as recipe `id` records, on `stream` (a cudaStream_t) of CUDA device
// `device`; returns the tensors the recorded call returned.
std::vector<at::Tensor> replay(int64_t id, const std::vector<at::Tensor>& inputs,
                               const std::vector<at::Tensor>& scratch, void* stream,
                               int64_t device);

// Whether `t`'s data is 16-byte aligned (what Triton's kernels were specialised on, and
// launch.signature requires).
inline bool aligned16(const at::Tensor& t) {
  return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0;
}

// Whether `stream` (of CUDA device `device`) is capturing a CUDA graph.
bool capturing(void* stream, int64_t device);

// The current CUDA stream of `device` (a cudaStream_t), as torch.cuda.current_stream gives it.
void* current_stream(int64_t device);

// Binds the autograd nodes' functions and types (autograd_nodes.cpp).
void bind_autograd_nodes(pybind11::module& m);

// Binds the saved-tensor hooks of mhc_recompute's blocks (saved_ranges.cpp).
void bind_saved_ranges(pybind11::module& m);

// The outputs an mhc_recompute block registered (saved_ranges.cpp's SavedRanges, whose `pack`
// is the block's saved-tensor pack hook).
class BlockOutputs {
 public:
  virtual ~BlockOutputs() = default;
  // Where `t` is (a view of) a registered output, in that output's storage, still alive, and
  // the block is: the saved-tensor hooks of its placeholder (what the block's pack hook makes,
  // in C++), the output's op counted among the packed ones; else nullptr. Needs the GIL.
  virtual std::unique_ptr<torch::autograd::SavedVariableHooks> placeholder_hooks(
      const at::Tensor& t) = 0;
  // Record op `fn(*args, **kwargs)`, which returned `output`, as the block's next op (the
  // ranges' `record`, its arguments given as a tuple). Needs the GIL.
  virtual void record(const pybind11::handle& fn, const pybind11::tuple& args,
                      const pybind11::handle& kwargs, const pybind11::handle& output) = 0;
};

// The block outputs `ranges` is (an mhc_recompute block's C++ ranges, `SavedRanges`), or
// nullptr for any other object.
BlockOutputs* block_outputs_of(const pybind11::handle& ranges);

// The block whose pack hook is on top of autograd's saved-tensor hooks on this thread, or
// nullptr (other hooks, none, or a torch that cannot save past them). Needs the GIL.
BlockOutputs* block_outputs_on_top();

// `t` saved for a node's backward, as SavedVariable(t, false) saves it under the hooks on top;
// where `block` (block_outputs_on_top) is not null, past the hooks: a registered output with
// the block's placeholder hooks (the placeholder the pack hook would make, with no Python call
// when saving nor when unpacking), any other tensor as autograd saves it without hooks (the
// block's pack hook would keep it as it is; autograd's version check on unpack).
torch::autograd::SavedVariable save_variable(const at::Tensor& t, BlockOutputs* block);

}  // namespace mhc
