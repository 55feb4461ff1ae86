// The saved-tensor hooks of an mhc_recompute block (mhc_megatron/recompute/manager.py) in C++:
// a block registers the storages of its recorded ops' outputs, and every tensor autograd saves
// inside the block's layers is looked up among them. Most saved tensors (an attention's or an
// MoE layer's own) are in none: one binary search of the address ranges, no Python frame. A
// tensor in a registered, still live storage of the output's dtype is replaced by a
// Placeholder (the block, the output and the view of it), which the unpack hook resolves from
// the block's recomputed outputs, recomputing the block (its Python `recompute()`) on the
// first unpack. The same decisions as the Python ranges of manager.py (_AddressRanges), which
// run where this extension is not built, except that a tensor subclass with a Python dispatch
// key is always kept as it is (the Python ranges find one that has a data pointer: only memory
// differs, not a result).
// The ops' C++ nodes save their other tensors past these hooks (save_variable): the pack hook
// would keep them as they are.
#include "saved_ranges.h"

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <optional>
#include <type_traits>

namespace mhc {

void SavedRanges::add(const at::Tensor& out, int64_t op, int64_t index) {
  const c10::Storage& storage = out.storage();
  const uintptr_t start = reinterpret_cast<uintptr_t>(storage.data());
  const uintptr_t end = start + storage.nbytes();
  auto at = std::upper_bound(ranges_.begin(), ranges_.end(), start,
                             [](uintptr_t p, const Range& r) { return p < r.start; });
  auto lo = at;
  while (lo != ranges_.begin() && std::prev(lo)->end > start) --lo;
  auto hi = at;
  while (hi != ranges_.end() && hi->start < end) ++hi;
  Range range{start, end, storage.getWeakStorageImpl(), out.scalar_type(), op, index};
  if (lo == hi) {
    ranges_.insert(lo, std::move(range));
  } else {
    *lo = std::move(range);
    ranges_.erase(std::next(lo), hi);
  }
}

const Range* SavedRanges::find(const at::Tensor& t) {
  const Range* r = locate(t);
  if (r != nullptr) ++full_lookups_;
  return checked(t, r);
}

py::object SavedRanges::lookup(const at::Tensor& t) {
  const Range* r = find(t);
  return r == nullptr ? py::none() : py::object(py::make_tuple(r->op, r->index));
}

// The placeholder of `t` where it is (a view of) a registered output and the block is alive.
std::optional<Placeholder> SavedRanges::placeholder(const at::Tensor& t) {
  const Range* r = find(t);
  if (r == nullptr) return std::nullopt;
  py::object block = block_ref_();
  if (block.is_none()) return std::nullopt;
  packed_ops_.insert(r->op);
  return Placeholder{std::move(block), this,
                     View{r->op, r->index, t.sizes().vec(), t.strides().vec(),
                          t.storage_offset()}};
}

py::object SavedRanges::pack(py::handle obj) {
  ++packs_;
  if (!THPVariable_Check(obj.ptr())) return py::reinterpret_borrow<py::object>(obj);
  std::optional<Placeholder> p = placeholder(THPVariable_Unpack(obj.ptr()));
  if (!p) return py::reinterpret_borrow<py::object>(obj);
  return py::cast(std::move(*p));
}

std::unique_ptr<torch::autograd::SavedVariableHooks> SavedRanges::placeholder_hooks(
    const at::Tensor& t) {
  std::optional<Placeholder> p = placeholder(t);
  if (!p) return nullptr;
  return std::make_unique<PlaceholderHooks>(std::move(*p));
}

PlaceholderHooks::~PlaceholderHooks() {
  if (!Py_IsInitialized()) {  // (the interpreter is gone: the block is left as it is)
    placeholder.block.release();
    return;
  }
  py::gil_scoped_acquire gil;
  placeholder.block = py::object();
}

py::list SavedRanges::entries() const {
  py::list out;
  for (const Range& r : ranges_) out.append(py::make_tuple(r.op, r.index, r.storage.expired()));
  return out;
}

py::list SavedRanges::recomputed_outputs() const {
  py::list out;
  for (const auto& outs : outputs_) {
    py::tuple op(outs.size());
    for (size_t i = 0; i < outs.size(); ++i) {
      op[i] = outs[i].defined() ? py::cast(outs[i]) : py::none();
    }
    out.append(std::move(op));
  }
  return out;
}

py::set SavedRanges::packed_ops() const {
  py::set out;
  for (int64_t op : packed_ops_) out.add(op);
  return out;
}

void SavedRanges::add_whole(const at::Tensor& t, int64_t op, int64_t index) {
  if (!t.defined() || !t.has_storage() || t.unsafeGetTensorImpl()->is_python_dispatch() ||
      t.storage_offset() != 0 || !t.is_contiguous() ||
      t.storage().nbytes() != static_cast<size_t>(t.numel()) * t.element_size()) {
    return;
  }
  add(t, op, index);
}

const Range* SavedRanges::locate(const at::Tensor& t) const {
  if (!t.defined() || !t.has_storage() || t.unsafeGetTensorImpl()->is_python_dispatch() ||
      ranges_.empty()) {
    return nullptr;
  }
  const uintptr_t ptr = reinterpret_cast<uintptr_t>(t.storage().data()) +
                        static_cast<uintptr_t>(t.storage_offset()) * t.element_size();
  auto at = std::upper_bound(ranges_.begin(), ranges_.end(), ptr,
                             [](uintptr_t p, const Range& r) { return p < r.start; });
  if (at == ranges_.begin()) return nullptr;
  const Range& r = *std::prev(at);
  return ptr < r.end ? &r : nullptr;
}

const Range* SavedRanges::checked(const at::Tensor& t, const Range* r) {
  if (r == nullptr || r->storage.expired() ||
      r->storage._unsafe_get_target() != t.storage().unsafeGetStorageImpl() ||
      t.scalar_type() != r->dtype) {
    return nullptr;
  }
  return r;
}

// The unpack hook: a tensor as it is; a placeholder resolves itself.
py::object unpack_saved(py::handle obj) {
  if (THPVariable_Check(obj.ptr())) return py::reinterpret_borrow<py::object>(obj);
  if (py::isinstance<Placeholder>(obj)) return py::cast(obj.cast<const Placeholder&>().unpack());
  return obj.attr("unpack")();
}

namespace {

// Whether this torch lets a thread save tensors past the saved-tensor hooks on its stack:
// `SavedTensorDefaultHooks::set_tracing` (torch >= 2.4; autograd then finds no hooks, as
// while Dynamo traces). Without it every tensor goes through the hooks, as before.
template <class Hooks, class = void>
struct CanSkipHooks : std::false_type {};
template <class Hooks>
struct CanSkipHooks<Hooks, std::void_t<decltype(Hooks::set_tracing(true))>> : std::true_type {};

// Autograd's saved-tensor hooks out of sight on this thread while alive (Hooks:
// at::SavedTensorDefaultHooks, a template parameter so that a torch without set_tracing never
// instantiates this).
template <class Hooks>
struct HooksSkipped {
  bool previous;
  HooksSkipped() : previous(Hooks::set_tracing(true)) {}
  ~HooksSkipped() { Hooks::set_tracing(previous); }
  HooksSkipped(const HooksSkipped&) = delete;
  HooksSkipped& operator=(const HooksSkipped&) = delete;
};

template <class Hooks>
torch::autograd::SavedVariable save_past_block(const at::Tensor& t, BlockOutputs* block) {
  if constexpr (CanSkipHooks<Hooks>::value) {
    if (block != nullptr && t.defined()) {
      std::unique_ptr<torch::autograd::SavedVariableHooks> hooks = block->placeholder_hooks(t);
      torch::autograd::SavedVariable saved = [&t] {
        HooksSkipped<Hooks> skipped;
        return torch::autograd::SavedVariable(t, false);
      }();
      if (hooks) saved.register_hooks(std::move(hooks));
      return saved;
    }
  }
  return torch::autograd::SavedVariable(t, false);
}

}  // namespace

BlockOutputs* block_outputs_on_top() {
  if constexpr (!CanSkipHooks<at::SavedTensorDefaultHooks>::value) {
    return nullptr;
  } else {
    const auto hooks = at::SavedTensorDefaultHooks::get_hooks();
    if (!hooks) return nullptr;
    PyObject* pack = hooks->first.ptr(&hooks->first.pyinterpreter());
    if (pack == nullptr || !PyMethod_Check(pack)) return nullptr;
    py::handle self = PyMethod_GET_SELF(pack);
    if (!py::isinstance<SavedRanges>(self)) return nullptr;
    return self.cast<SavedRanges*>();  // (a SavedRanges is a BlockOutputs)
  }
}

BlockOutputs* block_outputs_of(const py::handle& ranges) {
  return py::isinstance<SavedRanges>(ranges) ? ranges.cast<SavedRanges*>() : nullptr;
}

torch::autograd::SavedVariable save_variable(const at::Tensor& t, BlockOutputs* block) {
  return save_past_block<at::SavedTensorDefaultHooks>(t, block);
}

void bind_saved_ranges(py::module& m) {
  py::class_<SavedRanges>(m, "SavedRanges")
      .def(py::init<py::object>(), py::arg("block_ref"))
      .def("add", &SavedRanges::add, py::arg("out"), py::arg("op"), py::arg("index"))
      .def("record", &SavedRanges::record, py::arg("fn"), py::arg("args"), py::arg("kwargs"),
           py::arg("outputs"), "record an op's arguments and register its outputs")
      .def("recorded_ops", &SavedRanges::recorded_ops, py::arg("view_type"),
           "[(fn, packed args, kwargs, deps)] of the recorded ops, for a Python replay")
      .def("add_outputs", &SavedRanges::add_outputs, "register a recorded op's outputs")
      .def("lookup", &SavedRanges::lookup, "(op, index) of the output t is a view of, or None")
      .def("pack", &SavedRanges::pack, "the saved-tensor pack hook")
      .def("set_outputs", &SavedRanges::set_outputs, "the block's outputs, replayed in Python")
      .def("replay_native", &SavedRanges::replay_native, py::arg("generation"),
           py::arg("autocast"), "replay the needed ops by their sites: (ops, pairs), or None")
      .def("learn", &SavedRanges::learn, "teach an op's (or a pair's) replay site")
      .def("entries", &SavedRanges::entries)
      .def_property_readonly("recomputed_outputs", &SavedRanges::recomputed_outputs,
                             "the recomputed outputs, a tuple per op (None: not recomputed)")
      .def_property_readonly("packed_ops", &SavedRanges::packed_ops,
                             "the ops with an output replaced by a placeholder")
      .def_property_readonly("recorded", &SavedRanges::recorded, "how many ops are recorded")
      .def_property_readonly("full_lookups", &SavedRanges::full_lookups)
      .def_property_readonly("packs", &SavedRanges::packs, "the pack hook's calls");
  py::class_<Placeholder>(m, "Placeholder")
      .def("unpack", &Placeholder::unpack, "the saved tensor, recomputed")
      .def_property_readonly("view", &Placeholder::describe, "(op, index, size, stride, offset)")
      .def_property_readonly("block", [](const Placeholder& p) { return p.block; });
  m.def("unpack_saved", &unpack_saved, "the saved-tensor unpack hook");
}

}  // namespace mhc
