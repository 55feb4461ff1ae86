// The saved-tensor hooks of an mhc_recompute block (mhc_megatron/recompute/manager.py) in C++:
// a block registers the storages of its recorded ops' outputs, and every tensor autograd saves
// inside the block's layers is looked up among them. Most saved tensors (an attention's or an
// MoE layer's own) are in none: one binary search of the address ranges, no Python frame. A
// tensor in a registered, still live storage of the output's dtype is handed to the block's
// Python `on_hit(block_ref, tensor, op, index)`, which makes its placeholder. The same decisions
// as the Python ranges of manager.py (_AddressRanges), which run where this extension is not
// built, except that a tensor subclass with a Python dispatch key is always kept as it is (the
// Python ranges find one that has a data pointer: only memory differs, not a result).
// The ops' C++ nodes save their other tensors past these hooks (save_variable): the pack hook
// would keep them as they are.
#include "host_replay.h"

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace py = pybind11;

namespace mhc {
namespace {

struct Range {
  uintptr_t start;
  uintptr_t end;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  c10::ScalarType dtype;
  int64_t op;
  int64_t index;
};

class SavedRanges : public BlockOutputs {
 public:
  // block_ref: a weak reference to the block (no cycle block -> ranges -> block); on_hit:
  // on_hit(block_ref, tensor, op, index) -> what autograd stores for the tensor.
  SavedRanges(py::object block_ref, py::object on_hit)
      : block_ref_(std::move(block_ref)), on_hit_(std::move(on_hit)) {}

  // Register `out`, which owns its whole storage, as output `index` of op `op`. Ranges the new
  // storage overlaps belong to freed storages (live storages do not overlap): dropped.
  void add(const at::Tensor& out, int64_t op, int64_t index) {
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

  // The registered output `t` is (a view of), or nullptr: `t` in a range, in that range's
  // storage itself (still live), of its dtype. Tensor subclasses (a Python dispatch key) and
  // tensors without storage are in none.
  const Range* find(const at::Tensor& t) {
    const Range* r = locate(t);
    if (r != nullptr) ++full_lookups_;
    return checked(t, r);
  }

  // Whether `t` is (a view of) a registered output: what the pack hook looks up, uncounted.
  bool holds(const at::Tensor& t) const override { return checked(t, locate(t)) != nullptr; }

  // A recorded op's arguments as its block keeps them (manager.py's _BlockState.record):
  // `(packed, deps)`, `packed` the tuple of `args` with each tensor that is (a view of) a
  // registered output replaced by `view_type(op, index, size, stride, offset)` and every
  // other tensor by an alias without autograd history (the replay runs without grad, and the
  // block holds no reference into the autograd graph), other values as they are; `deps` the
  // ops of those outputs, in argument order. A plain tensor's alias is its `variable_data()`
  // (the same storage and geometry, made without an op dispatch; unlike `detach()` it has a
  // version counter of its own, which the replay does not read); a tensor of any other type
  // (a Parameter, a subclass) is detached by its own Python `detach`, as the Python ranges
  // do.
  py::tuple record_args(const py::tuple& args, const py::handle& view_type) {
    const size_t count = args.size();
    py::tuple packed(count);
    py::list deps;
    for (size_t i = 0; i < count; ++i) {
      py::handle a = args[i];
      if (!THPVariable_Check(a.ptr())) {
        packed[i] = py::reinterpret_borrow<py::object>(a);
        continue;
      }
      const at::Tensor& t = THPVariable_Unpack(a.ptr());
      const Range* r = find(t);
      if (r != nullptr) {
        packed[i] = view_type(r->op, r->index, int_tuple(t.sizes()), int_tuple(t.strides()),
                              t.storage_offset());
        deps.append(r->op);
      } else if (Py_TYPE(a.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
        packed[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(t.variable_data()));
      } else {
        packed[i] = a.attr("detach")();
      }
    }
    return py::make_tuple(std::move(packed), std::move(deps));
  }

  // Register the outputs of recorded op `op` (a tensor, or a tuple of them and other values):
  // output `index` where it is a tensor that owns its whole storage (offset 0, contiguous, as
  // many bytes as its elements; a placeholder is rebuilt as a view of the recomputed tensor).
  // Tensor subclasses with a Python dispatch key and tensors without storage are never found
  // (find), so they are not registered.
  void add_outputs(const py::handle& outputs, int64_t op) {
    if (THPVariable_Check(outputs.ptr())) {
      add_whole(THPVariable_Unpack(outputs.ptr()), op, 0);
    } else if (PyTuple_Check(outputs.ptr())) {
      const py::tuple outs = py::reinterpret_borrow<py::tuple>(outputs);
      for (size_t i = 0; i < outs.size(); ++i) {
        if (THPVariable_Check(outs[i].ptr())) {
          add_whole(THPVariable_Unpack(outs[i].ptr()), op, static_cast<int64_t>(i));
        }
      }
    }
  }

  py::object lookup(const at::Tensor& t) {
    const Range* r = find(t);
    return r == nullptr ? py::none() : py::object(py::make_tuple(r->op, r->index));
  }

  // The pack hook: the tensor itself, or on_hit's placeholder for a registered output.
  py::object pack(py::handle obj) {
    ++packs_;
    if (!THPVariable_Check(obj.ptr())) return py::reinterpret_borrow<py::object>(obj);
    const Range* r = find(THPVariable_Unpack(obj.ptr()));
    if (r == nullptr) return py::reinterpret_borrow<py::object>(obj);
    return on_hit_(block_ref_, obj, r->op, r->index);
  }

  // (op, index, expired) of every range held, in address order.
  py::list entries() const {
    py::list out;
    for (const Range& r : ranges_) out.append(py::make_tuple(r.op, r.index, r.storage.expired()));
    return out;
  }

  int64_t full_lookups() const { return full_lookups_; }
  int64_t packs() const { return packs_; }

 private:
  void add_whole(const at::Tensor& t, int64_t op, int64_t index) {
    if (!t.defined() || !t.has_storage() || t.unsafeGetTensorImpl()->is_python_dispatch() ||
        t.storage_offset() != 0 || !t.is_contiguous() ||
        t.storage().nbytes() != static_cast<size_t>(t.numel()) * t.element_size()) {
      return;
    }
    add(t, op, index);
  }

  static py::tuple int_tuple(c10::IntArrayRef values) {
    py::tuple out(values.size());
    for (size_t i = 0; i < values.size(); ++i) out[i] = py::int_(values[i]);
    return out;
  }

  // The range `t`'s data pointer falls in, or nullptr (one binary search). Tensor subclasses
  // (a Python dispatch key) and tensors without storage are in none.
  const Range* locate(const at::Tensor& t) const {
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

  // `r` where `t` is in its storage itself (still live), of its dtype, else nullptr.
  static const Range* checked(const at::Tensor& t, const Range* r) {
    if (r == nullptr || r->storage.expired() ||
        r->storage._unsafe_get_target() != t.storage().unsafeGetStorageImpl() ||
        t.scalar_type() != r->dtype) {
      return nullptr;
    }
    return r;
  }

  std::vector<Range> ranges_;  // sorted by start, disjoint
  py::object block_ref_;
  py::object on_hit_;
  int64_t full_lookups_ = 0;
  int64_t packs_ = 0;  // the pack hook's calls
};

// The unpack hook: a tensor as it is; a placeholder resolves itself (its `unpack()`).
py::object unpack_saved(py::handle obj) {
  if (THPVariable_Check(obj.ptr())) return py::reinterpret_borrow<py::object>(obj);
  return obj.attr("unpack")();
}

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
torch::autograd::SavedVariable save_past_block(const at::Tensor& t, const BlockOutputs* block) {
  if constexpr (CanSkipHooks<Hooks>::value) {
    if (block != nullptr && t.defined() && !block->holds(t)) {
      HooksSkipped<Hooks> skipped;
      return torch::autograd::SavedVariable(t, false);
    }
  }
  return torch::autograd::SavedVariable(t, false);
}

}  // namespace

const BlockOutputs* block_outputs_on_top() {
  if constexpr (!CanSkipHooks<at::SavedTensorDefaultHooks>::value) {
    return nullptr;
  } else {
    const auto hooks = at::SavedTensorDefaultHooks::get_hooks();
    if (!hooks) return nullptr;
    PyObject* pack = hooks->first.ptr(&hooks->first.pyinterpreter());
    if (pack == nullptr || !PyMethod_Check(pack)) return nullptr;
    py::handle self = PyMethod_GET_SELF(pack);
    if (!py::isinstance<SavedRanges>(self)) return nullptr;
    return self.cast<const SavedRanges*>();  // (a SavedRanges is a BlockOutputs)
  }
}

torch::autograd::SavedVariable save_variable(const at::Tensor& t, const BlockOutputs* block) {
  return save_past_block<at::SavedTensorDefaultHooks>(t, block);
}

void bind_saved_ranges(py::module& m) {
  py::class_<SavedRanges>(m, "SavedRanges")
      .def(py::init<py::object, py::object>(), py::arg("block_ref"), py::arg("on_hit"))
      .def("add", &SavedRanges::add, py::arg("out"), py::arg("op"), py::arg("index"))
      .def("record_args", &SavedRanges::record_args,
           "(packed args, deps) of a recorded op's arguments")
      .def("add_outputs", &SavedRanges::add_outputs, "register a recorded op's outputs")
      .def("lookup", &SavedRanges::lookup, "(op, index) of the output t is a view of, or None")
      .def("pack", &SavedRanges::pack, "the saved-tensor pack hook")
      .def("entries", &SavedRanges::entries)
      .def_property_readonly("full_lookups", &SavedRanges::full_lookups)
      .def_property_readonly("packs", &SavedRanges::packs, "the pack hook's calls");
  m.def("unpack_saved", &unpack_saved, "the saved-tensor unpack hook");
}

}  // namespace mhc
