// The recorded ops of an mhc_recompute block (mhc_megatron/recompute/manager.py) and their
// replay from C++. Each recorded op keeps, beside the arguments the block's Python replay
// takes, a description of them (dtypes, shapes, strides, alignment; the values of the others).
// A Python replay of an op (or of a fused pair) that ran one recorded recipe (host_replay.cpp)
// on its arguments teaches a replay site, keyed by that description (learn); a later block
// whose needed ops all have sites replays them without the ops' Python (replay_native): the
// same recipes on the same tensors, the same bits. The placeholders the pack hook made
// (saved_ranges.cpp) read the replayed outputs here.
#include "saved_ranges.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <unordered_map>

namespace mhc {

// What a Python replay of an op (or of a fused pair of ops) ran: one recipe, whose inputs are
// the op's arguments at `inputs` (positions in the op's arguments, followed for a pair by the
// second op's after its first), and whose returned tensors are the ops' outputs `outputs`
// ((which op of the pair, output index) each; (-1, -1): not an output).
struct ReplaySite {
  int64_t recipe;
  int64_t device;
  std::vector<int64_t> inputs;
  std::vector<std::pair<int64_t, int64_t>> outputs;
  std::vector<int64_t> counts;  // the outputs of each op of the pair
};

namespace {

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const {
    size_t h = key.size();
    for (int64_t v : key) {
      h ^= std::hash<int64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return h;
  }
};

// The replay sites learned in this process, of one launch-plan generation (a change of the
// kernels' tiles ends them all). Functions a key names are kept alive (their address is in it).
struct ReplaySites {
  int64_t generation = -1;
  std::unordered_map<std::vector<int64_t>, ReplaySite, KeyHash> sites;
};

ReplaySites& replay_sites() {
  static ReplaySites* all = new ReplaySites();  // (never destroyed: outlives the interpreter)
  return *all;
}

enum KeyTag : int64_t { SINGLE = 1, PAIR = 2, T_VIEW = 11, T_TENSOR = 12, T_NONE = 13,
                        T_BOOL = 14, T_INT = 15, T_FLOAT = 16, T_KWARGS = 17 };

void describe_geometry(std::vector<int64_t>& key, c10::ScalarType dtype, int64_t device,
                       c10::IntArrayRef size, c10::IntArrayRef stride, bool aligned) {
  key.push_back(static_cast<int64_t>(dtype));
  key.push_back(device);
  key.push_back(static_cast<int64_t>(size.size()));
  key.insert(key.end(), size.begin(), size.end());
  key.insert(key.end(), stride.begin(), stride.end());
  key.push_back(aligned ? 1 : 0);
}

// Appends the description of a non-tensor value; false where it has none (another type).
bool describe_value(std::vector<int64_t>& key, const py::handle& v) {
  if (v.is_none()) {
    key.push_back(T_NONE);
  } else if (PyBool_Check(v.ptr())) {
    key.push_back(T_BOOL);
    key.push_back(v.ptr() == Py_True ? 1 : 0);
  } else if (PyLong_CheckExact(v.ptr())) {
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow != 0) return false;
    key.push_back(T_INT);
    key.push_back(static_cast<int64_t>(x));
  } else if (PyFloat_CheckExact(v.ptr())) {
    const double x = PyFloat_AS_DOUBLE(v.ptr());
    int64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    key.push_back(T_FLOAT);
    key.push_back(bits);
  } else {
    return false;
  }
  return true;
}

// Whether a view at `offset` elements of `element_size` bytes into a replayed output is
// 16-byte aligned: the replay's outputs are allocations of their own (aligned), so the offset
// tells.
bool offset_aligned16(int64_t offset, size_t element_size) {
  return (offset * static_cast<int64_t>(element_size)) % 16 == 0;
}

}  // namespace

void SavedRanges::record(const py::handle& fn, const py::tuple& args, const py::handle& kwargs,
                         const py::handle& outputs) {
  const size_t count = args.size();
  const int64_t op = static_cast<int64_t>(ops_.size());
  OpRecord rec;
  rec.fn = py::reinterpret_borrow<py::object>(fn);
  rec.kwargs = py::reinterpret_borrow<py::object>(kwargs);
  rec.args.reserve(count);
  rec.key.push_back(reinterpret_cast<int64_t>(fn.ptr()));
  rec.key.push_back(static_cast<int64_t>(count));
  for (size_t i = 0; i < count; ++i) {
    py::handle a = args[i];
    if (!THPVariable_Check(a.ptr())) {
      rec.args.push_back(OpArg{OpArg::VALUE, {}, {}, py::reinterpret_borrow<py::object>(a)});
      rec.keyable = rec.keyable && describe_value(rec.key, a);
      continue;
    }
    const at::Tensor& t = THPVariable_Unpack(a.ptr());
    const Range* r = find(t);
    if (r != nullptr) {
      rec.key.push_back(T_VIEW);
      describe_geometry(rec.key, t.scalar_type(), t.get_device(), t.sizes(), t.strides(),
                        offset_aligned16(t.storage_offset(), t.element_size()));
      rec.deps.push_back(r->op);
      rec.args.push_back(OpArg{OpArg::VIEW,
                               View{r->op, r->index, t.sizes().vec(), t.strides().vec(),
                                    t.storage_offset()},
                               {}, {}});
      continue;
    }
    const bool plain = Py_TYPE(a.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
    py::object value = plain ? py::object() : py::object(a.attr("detach")());
    at::Tensor kept = plain ? t.variable_data() : THPVariable_Unpack(value.ptr());
    if (!kept.defined() || !kept.has_storage() ||
        kept.unsafeGetTensorImpl()->is_python_dispatch()) {
      rec.keyable = false;
    } else {
      rec.key.push_back(T_TENSOR);
      describe_geometry(rec.key, kept.scalar_type(), kept.get_device(), kept.sizes(),
                        kept.strides(), aligned16(kept));
    }
    rec.args.push_back(OpArg{OpArg::TENSOR, {}, std::move(kept), std::move(value)});
  }
  if (!kwargs.is_none()) {
    const py::dict kw = py::reinterpret_borrow<py::dict>(kwargs);
    rec.key.push_back(T_KWARGS);
    rec.key.push_back(static_cast<int64_t>(kw.size()));
    for (const auto& item : kw) {
      rec.key.push_back(static_cast<int64_t>(py::hash(item.first)));
      rec.keyable = rec.keyable && describe_value(rec.key, item.second);
    }
  }
  ops_.push_back(std::move(rec));
  add_outputs(outputs, op);
}

py::list SavedRanges::recorded_ops(const py::handle& view_type) const {
  py::list out;
  for (const OpRecord& rec : ops_) {
    py::tuple packed(rec.args.size());
    for (size_t i = 0; i < rec.args.size(); ++i) {
      const OpArg& arg = rec.args[i];
      if (arg.kind == OpArg::VIEW) {
        const View& v = arg.view;
        packed[i] = view_type(v.op, v.index, int_tuple(v.size), int_tuple(v.stride), v.offset);
      } else if (arg.value) {
        packed[i] = arg.value;
      } else {
        packed[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(arg.tensor));
      }
    }
    py::set deps;
    for (int64_t dep : rec.deps) deps.add(dep);
    out.append(py::make_tuple(rec.fn, std::move(packed),
                              rec.kwargs.is_none() ? py::object(py::dict()) : rec.kwargs,
                              std::move(deps)));
  }
  return out;
}

void SavedRanges::add_outputs(const py::handle& outputs, int64_t op) {
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

at::Tensor SavedRanges::resolve(const Placeholder& p) {
  if (!recomputed_) {
    py::gil_scoped_acquire gil;  // (the C++ placeholders unpack without it)
    p.block.attr("recompute")();
    TORCH_CHECK(recomputed_, "mhc_recompute: the block's recompute() gave its ranges no "
                "outputs (an internal error of mhc_megatron's recompute manager)");
  }
  at::Tensor out = view_of(p.view);
  TORCH_CHECK(out.defined(), "mhc_recompute: output ", p.view.index, " of recorded op ",
              p.view.op, " was not recomputed (an internal error of mhc_megatron's recompute "
              "manager)");
  return out;
}

void SavedRanges::set_outputs(const py::dict& outputs) {
  outputs_.assign(ops_.size(), {});
  for (const auto& item : outputs) {
    const int64_t op = item.first.cast<int64_t>();
    if (op >= static_cast<int64_t>(outputs_.size())) outputs_.resize(op + 1);
    auto& slot = outputs_[op];
    for (const py::handle o : py::reinterpret_borrow<py::tuple>(item.second)) {
      slot.push_back(THPVariable_Check(o.ptr()) ? THPVariable_Unpack(o.ptr()) : at::Tensor());
    }
  }
  recomputed_ = true;
}

py::object SavedRanges::replay_native(int64_t generation, int64_t autocast) {
  const int64_t count = static_cast<int64_t>(ops_.size());
  const ReplaySites& table = replay_sites();
  if (table.generation != generation || table.sites.empty() ||
      (!packed_ops_.empty() && *packed_ops_.rbegin() >= count)) {  // (an output added alone)
    return py::none();
  }
  const std::vector<char> need = needed();
  outputs_.assign(count, {});
  int64_t replayed = 0, pairs = 0;
  std::vector<int64_t> key;
  std::vector<at::Tensor> inputs;
  for (int64_t op = 0; op < count; ++op) {
    if (!need[op] || !outputs_[op].empty()) continue;
    const OpRecord& first = ops_[op];
    if (!first.keyable) return miss();
    const ReplaySite* site = nullptr;
    bool pair = op + 1 < count && need[op + 1] && pairable(op);
    if (pair) {
      site = find_site(key, PAIR, generation, autocast, op, true);
      pair = site != nullptr;
    }
    if (site == nullptr) site = find_site(key, SINGLE, generation, autocast, op, false);
    if (site == nullptr) return miss();
    inputs.clear();
    for (int64_t pos : site->inputs) {
      const OpArg& arg = flat_arg(op, pair, pos);
      if (arg.kind == OpArg::TENSOR) {
        inputs.push_back(arg.tensor);
        continue;
      }
      at::Tensor t = view_of(arg.view);
      if (!t.defined() || aligned16(t) != offset_aligned16(arg.view.offset, t.element_size())) {
        return miss();
      }
      inputs.push_back(std::move(t));
    }
    std::vector<at::Tensor> outs =
        replay(site->recipe, inputs, {}, current_stream(site->device), site->device);
    outputs_[op].resize(site->counts[0]);
    if (pair) outputs_[op + 1].resize(site->counts[1]);
    for (size_t k = 0; k < outs.size(); ++k) {
      const auto& [which, index] = site->outputs[k];
      if (which >= 0) outputs_[op + which][index] = std::move(outs[k]);
    }
    replayed += pair ? 2 : 1;
    pairs += pair ? 1 : 0;
  }
  recomputed_ = true;
  return py::make_tuple(replayed, pairs);
}

bool SavedRanges::learn(int64_t op, bool pair, int64_t recipe, int64_t device,
                        const std::vector<int64_t>& positions,
                        const std::vector<std::pair<int64_t, int64_t>>& slots,
                        const std::vector<int64_t>& counts, const py::list& flat,
                        int64_t generation, int64_t autocast) {
  const int64_t count = static_cast<int64_t>(ops_.size());
  if (op < 0 || op + (pair ? 1 : 0) >= count || (pair && !pairable(op)) ||
      counts.size() != (pair ? 2u : 1u)) {
    return false;
  }
  const size_t args = flat_count(op, pair);
  if (flat.size() != args) return false;
  for (size_t pos = 0; pos < args; ++pos) {  // the resolved views are what the key says
    const OpArg& arg = flat_arg(op, pair, static_cast<int64_t>(pos));
    if (arg.kind != OpArg::VIEW) continue;
    if (!THPVariable_Check(flat[pos].ptr())) return false;
    const at::Tensor& t = THPVariable_Unpack(flat[pos].ptr());
    if (t.sizes() != c10::IntArrayRef(arg.view.size) ||
        t.strides() != c10::IntArrayRef(arg.view.stride) ||
        aligned16(t) != offset_aligned16(arg.view.offset, t.element_size())) {
      return false;
    }
  }
  for (int64_t pos : positions) {
    if (pos < 0 || pos >= static_cast<int64_t>(args) ||
        flat_arg(op, pair, pos).kind == OpArg::VALUE) {
      return false;
    }
  }
  for (const auto& [which, index] : slots) {
    if (which >= static_cast<int64_t>(counts.size()) || (which >= 0 && index >= counts[which])) {
      return false;
    }
  }
  std::vector<int64_t> key;
  if (!make_key(key, pair ? PAIR : SINGLE, generation, autocast, op, pair)) return false;
  ReplaySites& table = replay_sites();
  if (table.generation != generation) {
    table.sites.clear();
    table.generation = generation;
  }
  const auto [site, added] = table.sites.insert_or_assign(
      std::move(key), ReplaySite{recipe, device, positions, slots, counts});
  if (added) {  // the functions' addresses are in the key: kept alive (never released)
    for (int64_t i = 0; i < (pair ? 2 : 1); ++i) {
      Py_INCREF(reinterpret_cast<PyObject*>(ops_[op + i].key[0]));
    }
  }
  return true;
}

py::tuple SavedRanges::int_tuple(c10::IntArrayRef values) {
  py::tuple out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = py::int_(values[i]);
  return out;
}

std::vector<char> SavedRanges::needed() const {
  const int64_t count = static_cast<int64_t>(ops_.size());
  std::vector<char> need(count, 0);
  for (int64_t op : packed_ops_) {
    if (op < count) need[op] = 1;
  }
  for (int64_t op = count - 1; op >= 0; --op) {
    if (!need[op]) continue;
    for (int64_t dep : ops_[op].deps) need[dep] = 1;
  }
  return need;
}

bool SavedRanges::pairable(int64_t op) const {
  const std::vector<OpArg>& args = ops_[op + 1].args;
  if (args.empty() || args[0].kind != OpArg::VIEW || args[0].view.op != op ||
      args[0].view.index != 0) {
    return false;
  }
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i].kind == OpArg::VIEW && args[i].view.op == op) return false;
  }
  return true;
}

size_t SavedRanges::flat_count(int64_t op, bool pair) const {
  return ops_[op].args.size() + (pair ? ops_[op + 1].args.size() - 1 : 0);
}

const OpArg& SavedRanges::flat_arg(int64_t op, bool pair, int64_t pos) const {
  const auto& first = ops_[op].args;
  if (!pair || pos < static_cast<int64_t>(first.size())) return first.at(pos);
  return ops_[op + 1].args.at(pos - first.size() + 1);
}

bool SavedRanges::make_key(std::vector<int64_t>& key, int64_t tag, int64_t generation,
                           int64_t autocast, int64_t op, bool pair) const {
  const OpRecord& first = ops_[op];
  if (!first.keyable || (pair && !ops_[op + 1].keyable)) return false;
  key.assign({tag, generation, autocast});
  key.insert(key.end(), first.key.begin(), first.key.end());
  if (pair) key.insert(key.end(), ops_[op + 1].key.begin(), ops_[op + 1].key.end());
  return true;
}

const ReplaySite* SavedRanges::find_site(std::vector<int64_t>& key, int64_t tag,
                                         int64_t generation, int64_t autocast, int64_t op,
                                         bool pair) const {
  if (!make_key(key, tag, generation, autocast, op, pair)) return nullptr;
  const auto& sites = replay_sites().sites;
  const auto found = sites.find(key);
  return found == sites.end() ? nullptr : &found->second;
}

at::Tensor SavedRanges::view_of(const View& v) const {
  if (v.op >= static_cast<int64_t>(outputs_.size()) ||
      v.index >= static_cast<int64_t>(outputs_[v.op].size())) {
    return at::Tensor();
  }
  const at::Tensor& out = outputs_[v.op][v.index];
  if (!out.defined()) return out;
  if (v.offset == 0 && out.sizes() == c10::IntArrayRef(v.size) &&
      out.strides() == c10::IntArrayRef(v.stride)) {
    return out;
  }
  return out.as_strided(v.size, v.stride, v.offset);
}

py::object SavedRanges::miss() {
  outputs_.clear();
  return py::none();
}

at::Tensor Placeholder::unpack() const { return ranges->resolve(*this); }

py::tuple Placeholder::describe() const {
  return py::make_tuple(view.op, view.index, py::tuple(py::cast(view.size)),
                        py::tuple(py::cast(view.stride)), view.offset);
}

}  // namespace mhc
