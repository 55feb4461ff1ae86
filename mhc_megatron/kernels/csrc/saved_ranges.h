// An mhc_recompute block's C++ half (mhc_megatron/recompute/manager.py): the storages of its
// recorded ops' outputs, its saved-tensor hooks (saved_ranges.cpp), its recorded ops and their
// replay from C++ (block_replay.cpp).
#pragma once

#include "host_replay.h"

#include <cstdint>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace mhc {

namespace py = pybind11;

// (hidden, as pybind11's own types: these hold Python objects, and live in this module only)
#define MHC_MODULE_LOCAL __attribute__((visibility("hidden")))

struct Range {
  uintptr_t start;
  uintptr_t end;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  c10::ScalarType dtype;
  int64_t op;
  int64_t index;
};

// Output `index` of recorded op `op` seen with size, stride and offset (manager.py's
// _OutputView).
struct View {
  int64_t op;
  int64_t index;
  std::vector<int64_t> size;
  std::vector<int64_t> stride;
  int64_t offset;
};

// A recorded op's argument: a view of an earlier op's output, a tensor the block keeps (an
// alias without autograd history), or another value. `value`: the Python object a Python replay
// passes (the value; for a kept tensor of another type than torch.Tensor, its Python
// `detach()`; none for a plain tensor, wrapped from `tensor` when a Python replay asks).
struct MHC_MODULE_LOCAL OpArg {
  enum Kind : int8_t { VIEW, TENSOR, VALUE } kind;
  View view;
  at::Tensor tensor;
  py::object value;
};

// A recorded op: its function and keywords, its arguments, the ops whose outputs they view, and
// the description a replay site is keyed by (keyable: every argument and keyword is a tensor,
// None, a bool, an int or a float; else the op has no site and its block replays in Python).
struct MHC_MODULE_LOCAL OpRecord {
  py::object fn;
  py::object kwargs;
  std::vector<OpArg> args;
  std::vector<int64_t> deps;
  std::vector<int64_t> key;
  bool keyable = true;
};

class SavedRanges;
struct ReplaySite;  // (block_replay.cpp)

// What the pack hook stores for a saved tensor that is a view of a registered output: the block
// (kept alive: its ranges hold the recorded ops and, after the replay, their outputs) and the
// view. Unpacking it resolves the view from the recomputed outputs.
struct MHC_MODULE_LOCAL Placeholder {
  py::object block;
  SavedRanges* ranges;  // the block's (alive as long as the block)
  View view;
  at::Tensor unpack() const;
  py::tuple describe() const;
};

// A placeholder as the saved-tensor hooks of a saved variable (BlockOutputs::placeholder_hooks):
// what the ops' C++ nodes save for a registered output. Unpacking takes the GIL only where the
// block is still to be recomputed; releasing takes it to let go of the block.
struct MHC_MODULE_LOCAL PlaceholderHooks final : torch::autograd::SavedVariableHooks {
  explicit PlaceholderHooks(Placeholder p) : placeholder(std::move(p)) {}
  void call_pack_hook(const at::Tensor&) override {}  // (the view is the placeholder's)
  at::Tensor call_unpack_hook() override { return placeholder.unpack(); }
  ~PlaceholderHooks() override;
  Placeholder placeholder;
};

class MHC_MODULE_LOCAL SavedRanges : public BlockOutputs {
 public:
  // block_ref: a weak reference to the block (no cycle block -> ranges -> block), whose
  // `recompute()` fills these ranges' outputs (replay_native, or set_outputs).
  explicit SavedRanges(py::object block_ref) : block_ref_(std::move(block_ref)) {}

  // Register `out`, which owns its whole storage, as output `index` of op `op`. Ranges the new
  // storage overlaps belong to freed storages (live storages do not overlap): dropped.
  void add(const at::Tensor& out, int64_t op, int64_t index);

  // The registered output `t` is (a view of), or nullptr: `t` in a range, in that range's
  // storage itself (still live), of its dtype. Tensor subclasses (a Python dispatch key) and
  // tensors without storage are in none.
  const Range* find(const at::Tensor& t);

  std::unique_ptr<torch::autograd::SavedVariableHooks> placeholder_hooks(
      const at::Tensor& t) override;

  // Record op `fn(*args, **kwargs)` (kwargs a dict or None), which returned `outputs`, as the
  // next op (its index: the ops recorded before it) (manager.py's _BlockState.record): each
  // argument that is (a view of) a registered output kept as that view, every other tensor as
  // an alias without autograd history (the replay runs without grad, and the block holds no
  // reference into the autograd graph), other values as they are; then its outputs registered
  // (add_outputs). A plain tensor's alias is its `variable_data()` (the same storage and
  // geometry, made without an op dispatch; unlike `detach()` it has a version counter of its
  // own, which the replay does not read); a tensor of any other type (a Parameter, a
  // subclass) is detached by its own Python `detach`, as the Python ranges do. No Python object
  // is made for a plain tensor or a view: recorded_ops makes them for a Python replay.
  void record(const py::handle& fn, const py::tuple& args, const py::handle& kwargs,
              const py::handle& outputs) override;

  // The recorded ops as a Python replay takes them: a list of `(fn, packed, kwargs, deps)`,
  // `packed` the tuple of the op's arguments with each view of an output as
  // `view_type(op, index, size, stride, offset)` and each kept tensor as its alias, `deps`
  // the set of the ops those views are of.
  py::list recorded_ops(const py::handle& view_type) const;

  // Register the outputs of recorded op `op` (a tensor, or a tuple of them and other values):
  // output `index` where it is a tensor that owns its whole storage (offset 0, contiguous, as
  // many bytes as its elements; a placeholder is rebuilt as a view of the recomputed tensor).
  // Tensor subclasses with a Python dispatch key and tensors without storage are never found
  // (find), so they are not registered.
  void add_outputs(const py::handle& outputs, int64_t op);

  py::object lookup(const at::Tensor& t);

  // The pack hook: the tensor itself, or a Placeholder for a (view of a) registered output
  // (the tensor itself once the block is gone).
  py::object pack(py::handle obj);

  // The tensor a placeholder stands for: its view of the recomputed output (the block
  // recomputed first, once, under the GIL).
  at::Tensor resolve(const Placeholder& p);

  // The block's recomputed outputs, from its Python replay: {op: tuple of outputs}.
  void set_outputs(const py::dict& outputs);

  // Replays the needed ops (those whose outputs were packed, and the ops their arguments view)
  // in forward order, each op or fused pair by its replay site (learn): `(ops, pairs)` replayed,
  // or None where an op has no site of `generation` and `autocast` (or an output the site
  // expects is missing, or a view's alignment is not the site's); then nothing is kept and the
  // block replays in Python.
  py::object replay_native(int64_t generation, int64_t autocast);

  // Teach the replay site of op `op` (with the next op where `pair`) from its Python replay,
  // which ran recipe `recipe` on `device`: its inputs the arguments at `positions` of `flat`
  // (the op's arguments as the replay resolved them, followed for a pair by the second op's
  // after its first), its returned tensors the ops' outputs `slots` ((which, index) each, or
  // (-1, -1)), `counts` the ops' outputs. Nothing is learned where the op has no key or the
  // resolved arguments are not what the key describes. Returns whether a site was learned.
  bool learn(int64_t op, bool pair, int64_t recipe, int64_t device,
             const std::vector<int64_t>& positions,
             const std::vector<std::pair<int64_t, int64_t>>& slots,
             const std::vector<int64_t>& counts, const py::list& flat, int64_t generation,
             int64_t autocast);

  // (op, index, expired) of every range held, in address order.
  py::list entries() const;

  // The recomputed outputs, a tuple per op (None for an output not recomputed; empty before the
  // block is recomputed).
  py::list recomputed_outputs() const;

  py::set packed_ops() const;

  int64_t recorded() const { return static_cast<int64_t>(ops_.size()); }
  int64_t full_lookups() const { return full_lookups_; }
  int64_t packs() const { return packs_; }

 private:
  void add_whole(const at::Tensor& t, int64_t op, int64_t index);
  std::optional<Placeholder> placeholder(const at::Tensor& t);
  static py::tuple int_tuple(c10::IntArrayRef values);
  // The range `t`'s data pointer falls in, or nullptr (one binary search). Tensor subclasses
  // (a Python dispatch key) and tensors without storage are in none.
  const Range* locate(const at::Tensor& t) const;
  // `r` where `t` is in its storage itself (still live), of its dtype, else nullptr.
  static const Range* checked(const at::Tensor& t, const Range* r);
  // The ops to replay: those whose outputs were packed, and the ops their arguments view.
  std::vector<char> needed() const;
  // Whether op `op` and the next may replay as one (manager.py's _replay_fused): the next op's
  // first argument views this op's first output, and no other of its arguments views this op.
  bool pairable(int64_t op) const;
  size_t flat_count(int64_t op, bool pair) const;
  // Argument `pos` of op `op`'s arguments, followed for a pair by the second op's after its first.
  const OpArg& flat_arg(int64_t op, bool pair, int64_t pos) const;
  bool make_key(std::vector<int64_t>& key, int64_t tag, int64_t generation, int64_t autocast,
                int64_t op, bool pair) const;
  const ReplaySite* find_site(std::vector<int64_t>& key, int64_t tag, int64_t generation,
                              int64_t autocast, int64_t op, bool pair) const;
  // The recomputed output a view is of, seen as the view (the output itself where the view is
  // all of it); undefined where that output is not held.
  at::Tensor view_of(const View& v) const;
  py::object miss();

  std::vector<Range> ranges_;  // sorted by start, disjoint
  std::vector<OpRecord> ops_;  // the recorded ops
  std::set<int64_t> packed_ops_;  // the ops with an output replaced by a placeholder
  std::vector<std::vector<at::Tensor>> outputs_;  // the recomputed outputs, by op
  bool recomputed_ = false;
  py::object block_ref_;
  int64_t full_lookups_ = 0;
  int64_t packs_ = 0;  // the pack hook's calls
};

// The unpack hook: a tensor as it is; a placeholder resolves itself.
py::object unpack_saved(py::handle obj);

}  // namespace mhc
