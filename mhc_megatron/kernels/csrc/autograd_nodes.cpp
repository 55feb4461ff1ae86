// The autograd nodes of the two fused ops of a sublayer, "pre" and "combine", in C++
// (mhc_megatron/kernels/native_autograd.py): an op call whose forward is replayed from a recipe
// (host_replay.cpp) gets one of these nodes instead of a Python autograd function, so that its
// backward runs on autograd's device thread without the interpreter: the node looks up the
// recipe of its backward variant and replays it. Where it has none yet, or the gradients it is
// handed are not what a recipe was recorded for (undefined, strided, misaligned, another dtype),
// or a CUDA graph is being captured, it calls the op's Python backward (which records the
// recipe), under the GIL.
#include "host_replay.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <deque>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <type_traits>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace mhc {
namespace {

// How autograd holds its nodes: std::shared_ptr (torch 2.11) or c10::intrusive_ptr (torch 2.14).
using NodePtr = decltype(torch::autograd::Edge{}.function);

template <class N>
void delete_node(N* node) {
  deleteNode(node);  // torch::autograd::deleteNode, found through N's base (shared_ptr torch)
}

// Storage for the nodes of type N, reused: a node is made on the thread that runs the forward
// and freed on autograd's device thread. Through glibc's malloc a pre node (1120 bytes with
// torch 2.11: past the per-thread caches and the small bins) makes the arena consolidate its
// fast bins on every allocation, which the frees from the other thread keep filling. Freed
// storage goes onto a free list (up to kMaxBlocks blocks) that the next node of the type takes.
template <class N>
class NodeStorage {
 public:
  static void* take() {
    Blocks& b = blocks();
    {
      std::lock_guard<std::mutex> lock(b.mutex);
      if (!b.free.empty()) {
        void* block = b.free.back();
        b.free.pop_back();
        return block;
      }
    }
    return ::operator new(sizeof(N));
  }

  // how many freed blocks the list holds
  static size_t free_blocks() {
    Blocks& b = blocks();
    std::lock_guard<std::mutex> lock(b.mutex);
    return b.free.size();
  }

  static void give(void* block) noexcept {
    Blocks& b = blocks();
    {
      std::lock_guard<std::mutex> lock(b.mutex);
      if (b.free.size() < kMaxBlocks) {
        b.free.push_back(block);  // (reserved: never reallocates)
        return;
      }
    }
    ::operator delete(block);
  }

 private:
  // the nodes alive at once: two a sublayer for each micro-batch in flight
  static constexpr size_t kMaxBlocks = 2048;
  struct Blocks {
    std::mutex mutex;
    std::vector<void*> free;
    Blocks() { free.reserve(kMaxBlocks); }
  };
  static Blocks& blocks() {
    static Blocks* b = new Blocks();  // (never destroyed: nodes may be freed at exit)
    return *b;
  }
};

// A node type whose storage comes from NodeStorage (a base of the node: `delete` through a
// Node* finds these through the node's virtual destructor).
template <class N>
struct PooledNode {
  static void* operator new(size_t size) {
    return size == sizeof(N) ? NodeStorage<N>::take() : ::operator new(size);
  }
  static void operator delete(void* block, size_t size) noexcept {
    if (size == sizeof(N)) {
      NodeStorage<N>::give(block);
    } else {
      ::operator delete(block);
    }
  }
};

template <class N>
auto make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::shared_ptr<N>(new N(), [](N* node) { delete_node(node); });
  } else {
    return c10::make_intrusive<N>();
  }
}

// Whether `t` is what a recipe reads for a tensor of `dtype` on `device`: contiguous, 16-byte
// aligned (as launch.signature requires), on that device.
bool dense(const at::Tensor& t, at::ScalarType dtype, const at::Device& device) {
  return t.defined() && t.scalar_type() == dtype && t.is_contiguous() && aligned16(t) &&
         t.device() == device;
}

at::Tensor tensor_or_undefined(const py::handle& h) {
  return h.is_none() ? at::Tensor() : h.cast<at::Tensor>();
}

// A reference to a Python object that a node or table may drop on a thread without the GIL.
struct PyRef {
  PyObject* obj = nullptr;
  explicit PyRef(py::object o) : obj(o.release().ptr()) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (obj != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(obj);
    }
  }
  py::handle get() const { return py::handle(obj); }
};

// Calls a Python backward (the GIL held); its exception becomes a C++ one (the engine
// re-raises it in the thread that called backward).
template <class... Args>
py::tuple call_python(const PyRef& fn, Args&&... args) {
  try {
    return fn.get()(std::forward<Args>(args)...).template cast<py::tuple>();
  } catch (py::error_already_set& error) {
    throw std::runtime_error(error.what());
  }
}

// One recorded forward of an op (a plan and key of host_replay.run) and the recipes of its
// backward, one per (variant, signature of the per-call tensors, stream): filled by the op's
// Python backward, read by the nodes. Shared by every call of that forward.
struct OpTable {
  struct Backward {
    int64_t variant;
    std::vector<int64_t> signature;
    void* stream;
    int64_t recipe;
    std::vector<at::Tensor> scratch;
  };

  int64_t forward_recipe, device;
  PyRef python_backward;
  std::mutex mutex;
  std::deque<Backward> backward;  // entries never move nor change once added

  OpTable(int64_t forward_recipe, int64_t device, py::object python_backward)
      : forward_recipe(forward_recipe), device(device),
        python_backward(std::move(python_backward)) {}

  const Backward* find(int64_t variant, const std::vector<int64_t>& signature, void* stream) {
    std::lock_guard<std::mutex> lock(mutex);
    for (const Backward& b : backward) {
      if (b.variant == variant && b.stream == stream && b.signature == signature) return &b;
    }
    return nullptr;
  }

  void add(int64_t variant, std::vector<int64_t> signature, void* stream, int64_t recipe,
           std::vector<at::Tensor> scratch) {
    std::lock_guard<std::mutex> lock(mutex);
    for (const Backward& b : backward) {
      if (b.variant == variant && b.stream == stream && b.signature == signature) return;
    }
    constexpr size_t kMaxEntries = 32;  // variants x streams x signatures seen in practice: few
    if (backward.size() < kMaxEntries) {
      backward.push_back({variant, std::move(signature), stream, recipe, std::move(scratch)});
    }
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mutex);
    return backward.size();
  }
};

// The handoff of combine's upstream gradient and H_res to the pre of the same x (handoff.py's
// DxLink): made by pre's call from the x it read, claimed by the first combine on that same x;
// combine's backward parks the pair, pre's takes it.
struct Link {
  at::Tensor g, h_res;
  bool pending = false;
  // pre's x: its root (its base where x is a view), held weakly, and x's geometry and version
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> root;
  const void* data;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  int64_t version;
  bool claimed = false;

  static const at::TensorBase& root_of(const at::Tensor& x) {
    return x.is_view() ? x._base() : x;
  }

  explicit Link(const at::Tensor& x)
      : root(root_of(x).getIntrusivePtr()), data(x.data_ptr()), sizes(x.sizes().vec()),
        strides(x.strides().vec()), dtype(x.scalar_type()), version(x._version()) {}

  // Whether `x` is pre's x (the same tensor, or an equal view of the same root: address,
  // sizes, strides, dtype), unmodified since pre read it, and needs a gradient: then the
  // link is the combine's (once).
  bool claim(const at::Tensor& x) {
    if (claimed || !x.requires_grad() || x.data_ptr() != data || x.scalar_type() != dtype ||
        x.sizes() != c10::IntArrayRef(sizes) || x.strides() != c10::IntArrayRef(strides) ||
        x._version() != version || root.lock().get() != root_of(x).unsafeGetTensorImpl()) {
      return false;
    }
    claimed = true;
    return true;
  }

  void park(at::Tensor g_, at::Tensor h_res_) {
    g = std::move(g_);
    h_res = std::move(h_res_);
    pending = true;
  }

  bool take(at::Tensor& g_, at::Tensor& h_res_) {
    if (!pending) return false;
    g_ = std::move(g);
    h_res_ = std::move(h_res);
    g = at::Tensor();
    h_res = at::Tensor();
    pending = false;
    return true;
  }
};

// pre's backward: grads (dy, dh_pre, dh_post, dh_res) -> (dx, dphi, dalpha, dbias).
struct PreBackward : public Node, public PooledNode<PreBackward> {
  SavedVariable x_, phi_, alpha_, bias_, ht_, rstd_, h_pre_;
  std::shared_ptr<OpTable> table_;
  std::shared_ptr<Link> link_;
  std::vector<at::Tensor> main_grads_;  // Megatron's main_grad buffers of phi, alpha, bias
  std::vector<int64_t> main_signature_;
  std::shared_ptr<PyRef> params_;  // with main_grads_: the parameters, to flag

  std::string name() const override { return "MHCPreBackward"; }

  void release_variables() override {
    for (SavedVariable* s : {&x_, &phi_, &alpha_, &bias_, &ht_, &rstd_, &h_pre_}) s->reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    at::Tensor g_combine, h_res_combine;
    const bool fold = link_ && link_->take(g_combine, h_res_combine);
    const at::Tensor x = x_.unpack(), phi = phi_.unpack(), alpha = alpha_.unpack(),
                     bias = bias_.unpack(), ht = ht_.unpack(), rstd = rstd_.unpack(),
                     h_pre = h_pre_.unpack();
    const at::Tensor &dy = grads[0], &dh_pre = grads[1], &dh_post = grads[2], &dh_res = grads[3];
    const int64_t device = table_->device;
    void* stream = current_stream(device);
    const auto dev = x.device();
    const bool replayable =
        dense(dy, x.scalar_type(), dev) && dense(dh_post, at::kFloat, dev) &&
        dense(dh_res, at::kFloat, dev) && (!dh_pre.defined() || dense(dh_pre, at::kFloat, dev)) &&
        (!fold || (dense(g_combine, x.scalar_type(), dev) &&
                   dense(h_res_combine, at::kFloat, dev))) &&
        !capturing(stream, device);
    const int64_t variant = (dh_pre.defined() ? 2 : 0) | (fold ? 1 : 0);
    const OpTable::Backward* recipe =
        replayable ? table_->find(variant, main_signature_, stream) : nullptr;
    variable_list out;
    if (recipe != nullptr) {
      std::vector<at::Tensor> inputs = {x, dy, dh_pre.defined() ? dh_pre : dh_post, dh_post,
                                        dh_res, ht, rstd, alpha, bias, h_pre, phi};
      if (fold) {
        inputs.push_back(g_combine);
        inputs.push_back(h_res_combine);
      }
      inputs.insert(inputs.end(), main_grads_.begin(), main_grads_.end());
      out = replay(recipe->recipe, inputs, recipe->scratch, stream, device);
    } else {
      py::gil_scoped_acquire gil;
      py::tuple r = call_python(table_->python_backward, x, phi, alpha, bias, ht, rstd, h_pre, dy,
                                dh_pre, dh_post, dh_res, g_combine, h_res_combine, main_grads_);
      out = {tensor_or_undefined(r[0]), tensor_or_undefined(r[1]), tensor_or_undefined(r[2]),
             tensor_or_undefined(r[3])};
      const int64_t rid = r[4].cast<int64_t>();
      if (replayable && rid >= 0) {
        table_->add(variant, main_signature_, stream, rid, r[5].cast<std::vector<at::Tensor>>());
      }
    }
    if (params_) {  // Megatron's protocol: the gradients are in main_grad, skip .grad
      py::gil_scoped_acquire gil;
      for (py::handle p : params_->get()) p.attr("grad_added_to_main_grad") = true;
    }
    return out;
  }
};

// combine's backward: grads (g) -> (dx, df, dbias, dh_res, dh_post); no dx with the link.
struct CombineBackward : public Node, public PooledNode<CombineBackward> {
  SavedVariable x_, f_, f_bias_, h_res_, h_post_;
  std::shared_ptr<OpTable> table_;
  std::shared_ptr<Link> link_;
  int64_t channels_ = 0;

  std::string name() const override { return "MHCCombineBackward"; }

  void release_variables() override {
    for (SavedVariable* s : {&x_, &f_, &f_bias_, &h_res_, &h_post_}) s->reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const at::Tensor x = x_.unpack(), f = f_.unpack(), f_bias = f_bias_.unpack(),
                     h_res = h_res_.unpack(), h_post = h_post_.unpack();
    at::Tensor g = grads[0];
    const bool fold = static_cast<bool>(link_);
    const int64_t device = table_->device;
    void* stream = current_stream(device);
    const bool replayable = dense(g, x.scalar_type(), x.device()) && !capturing(stream, device);
    static const std::vector<int64_t> no_signature;
    const OpTable::Backward* recipe =
        replayable ? table_->find(fold, no_signature, stream) : nullptr;
    at::Tensor dx, df, dh_res, dh_post;
    if (recipe != nullptr) {
      auto out = replay(recipe->recipe, {g, x, f, f_bias.defined() ? f_bias : f, h_res, h_post},
                        recipe->scratch, stream, device);
      if (fold) {
        df = out[0], dh_res = out[1], dh_post = out[2];
      } else {
        dx = out[0], df = out[1], dh_res = out[2], dh_post = out[3];
      }
    } else {
      py::gil_scoped_acquire gil;
      py::tuple r = call_python(table_->python_backward, x, f, f_bias, h_res, h_post, g, fold);
      dx = tensor_or_undefined(r[0]), df = tensor_or_undefined(r[1]);
      dh_res = tensor_or_undefined(r[2]), dh_post = tensor_or_undefined(r[3]);
      const int64_t rid = r[4].cast<int64_t>();
      g = tensor_or_undefined(r[5]);  // as the kernel read it (contiguous)
      if (replayable && rid >= 0) table_->add(fold, no_signature, stream, rid, {});
    }
    at::Tensor dbias;
    if (f_bias.defined() && should_compute_output(2)) {
      // as the Python op: bf16/fp16 sums accumulate in fp32 inside torch's reduction
      const bool f32 = f_bias.scalar_type() == at::kFloat;
      dbias = at::sum(df.view({-1, channels_}), {0}, false,
                      f32 ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt)
                  .to(f_bias.scalar_type());
    }
    if (fold) link_->park(g, h_res);  // pre's backward adds H_res^T g
    return {dx, df, dbias, dh_res, dh_post};
  }
};

// pre's forward from its recipe: (y, h_pre, h_post, h_res), recorded with a PreBackward node.
std::vector<at::Tensor> pre_apply(const std::shared_ptr<OpTable>& table, const at::Tensor& x,
                                  const at::Tensor& phi, const at::Tensor& alpha,
                                  const at::Tensor& bias, const std::vector<at::Tensor>& scratch,
                                  std::shared_ptr<Link> link, std::vector<at::Tensor> main_grads,
                                  py::object params) {
  void* stream = current_stream(table->device);
  // y, h_pre, h_post, h_res, ht, rstd
  std::vector<at::Tensor> outs =
      replay(table->forward_recipe, {x, phi, alpha, bias}, scratch, stream, table->device);
  auto node = make_node<PreBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, phi, alpha, bias));
  // inside an mhc_recompute block only x can be a block output (the block's hooks see it)
  BlockOutputs* block = block_outputs_on_top();
  node->x_ = save_variable(x, block);
  node->phi_ = save_variable(phi, block);
  node->alpha_ = save_variable(alpha, block);
  node->bias_ = save_variable(bias, block);
  node->ht_ = save_variable(outs[4], block);
  node->rstd_ = save_variable(outs[5], block);
  // h_pre's values, not the output itself (an output saved as a plain tensor would hold its
  // own node): an alias of it without autograd history, sharing its version counter
  node->h_pre_ = save_variable(outs[1].detach(), block);
  node->table_ = table;
  node->link_ = std::move(link);
  for (const at::Tensor& m : main_grads) {
    node->main_signature_.push_back(static_cast<int64_t>(m.scalar_type()));
    node->main_signature_.push_back(aligned16(m));
  }
  node->main_grads_ = std::move(main_grads);
  if (!node->main_grads_.empty()) node->params_ = std::make_shared<PyRef>(std::move(params));
  outs.resize(4);
  torch::autograd::set_history(outs, NodePtr(node));
  return outs;
}

// combine's forward from its recipe: x', recorded with a CombineBackward node.
at::Tensor combine_apply(const std::shared_ptr<OpTable>& table, const at::Tensor& x,
                         const at::Tensor& f, const std::optional<at::Tensor>& f_bias,
                         const at::Tensor& h_res, const at::Tensor& h_post,
                         std::shared_ptr<Link> link) {
  void* stream = current_stream(table->device);
  const at::Tensor bias = f_bias.has_value() ? *f_bias : at::Tensor();
  std::vector<at::Tensor> outs =
      replay(table->forward_recipe, {x, f, bias.defined() ? bias : f, h_res, h_post}, {}, stream,
             table->device);
  auto node = make_node<CombineBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, f, bias, h_res, h_post));
  BlockOutputs* block = block_outputs_on_top();  // (see pre_apply)
  node->x_ = save_variable(x, block);
  node->f_ = save_variable(f, block);
  node->f_bias_ = save_variable(bias, block);
  node->h_res_ = save_variable(h_res, block);
  node->h_post_ = save_variable(h_post, block);
  node->table_ = table;
  node->link_ = std::move(link);
  node->channels_ = f.size(-1);
  torch::autograd::set_history(outs[0], NodePtr(node));
  return outs[0];
}

// A call site's forward: the table and scratch of the recipe its last call replayed, and what
// that call's operands were (dtype, sizes, strides; the stream it ran on), so that a call with
// operands like them replays the same recipe without the op's Python (checks, plan, key and
// recipe lookup). Anything else (another shape or dtype, a misaligned or strided operand,
// another device or stream, a CUDA graph being captured: fresh temporaries) is a miss, and the
// op takes its Python path, which may make a new site.
struct Site {
  struct Operand {
    bool defined = false;
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> sizes, strides;
  };

  std::shared_ptr<OpTable> table;
  std::vector<at::Tensor> scratch;
  void* stream = nullptr;
  std::vector<Operand> operands;

  Site(std::shared_ptr<OpTable> table_, std::vector<at::Tensor> scratch_,
       const std::vector<std::optional<at::Tensor>>& operands_)
      : table(std::move(table_)), scratch(std::move(scratch_)),
        stream(current_stream(table->device)) {
    for (const auto& t : operands_) {
      Operand o;
      if (t.has_value() && t->defined()) {
        o.defined = true;
        o.dtype = t->scalar_type();
        o.sizes = t->sizes().vec();
        o.strides = t->strides().vec();
      }
      operands.push_back(std::move(o));
    }
  }

  bool matches(std::initializer_list<const at::Tensor*> ts) const {
    if (ts.size() != operands.size()) return false;
    const int64_t device = table->device;
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    if (impl->getDevice().index() != device || current_stream(device) != stream) return false;
    size_t i = 0;
    for (const at::Tensor* t : ts) {
      const Operand& o = operands[i++];
      if (t->defined() != o.defined) return false;
      if (!o.defined) continue;
      if (!t->is_cuda() || t->get_device() != device || t->scalar_type() != o.dtype ||
          t->sizes() != c10::IntArrayRef(o.sizes) || t->strides() != c10::IntArrayRef(o.strides) ||
          !aligned16(*t)) {
        return false;
      }
    }
    return !capturing(stream, device);  // (captured calls take fresh temporaries)
  }
};

// pre's forward at a call site: as pre_apply where the operands match the site, else None.
std::optional<std::vector<at::Tensor>> pre_site_apply(
    const Site& site, const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha,
    const at::Tensor& bias, std::shared_ptr<Link> link, std::vector<at::Tensor> main_grads,
    py::object params) {
  if (!site.matches({&x, &phi, &alpha, &bias})) return std::nullopt;
  return pre_apply(site.table, x, phi, alpha, bias, site.scratch, std::move(link),
                   std::move(main_grads), std::move(params));
}

// The combine's forward at a call site: as combine_apply where the operands match, else None.
std::optional<at::Tensor> combine_site_apply(const Site& site, const at::Tensor& x,
                                             const at::Tensor& f,
                                             const std::optional<at::Tensor>& f_bias,
                                             const at::Tensor& h_res, const at::Tensor& h_post,
                                             std::shared_ptr<Link> link) {
  const at::Tensor bias = f_bias.has_value() ? *f_bias : at::Tensor();
  if (!site.matches({&x, &f, &bias, &h_res, &h_post})) return std::nullopt;
  return combine_apply(site.table, x, f, f_bias, h_res, h_post, std::move(link));
}

// -- the module's calls: one call into the extension an op call, from the module's call site

constexpr const char* kSiteCapsule = "mhc.Site";

// A capsule holding a Site (a shared_ptr to it), for the fast calls' first argument.
py::object site_capsule(std::shared_ptr<Site> site) {
  auto* held = new std::shared_ptr<Site>(std::move(site));
  PyObject* capsule = PyCapsule_New(held, kSiteCapsule, [](PyObject* c) {
    delete static_cast<std::shared_ptr<Site>*>(PyCapsule_GetPointer(c, kSiteCapsule));
  });
  if (capsule == nullptr) {
    delete held;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

// torch.Tensor and torch.nn.Parameter: the Python types of the tensors the fast calls take
// (a subclass, such as a DTensor, takes the op's Python path)
PyTypeObject* tensor_type = nullptr;
PyTypeObject* parameter_type = nullptr;

bool plain_tensor(PyObject* o) {
  return Py_TYPE(o) == tensor_type || Py_TYPE(o) == parameter_type;
}

// Whether autograd records an op on these tensors (triton_common.records_autograd).
bool records(std::initializer_list<const at::Tensor*> ts) {
  if (!at::GradMode::is_enabled() || c10::InferenceMode::is_enabled()) return false;
  for (const at::Tensor* t : ts) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

// The pre node (one of ours) that made `h_res`, or nullptr.
const PreBackward* pre_node_of(const at::Tensor& h_res) {
  return dynamic_cast<const PreBackward*>(h_res.grad_fn().get());
}

const Site& site_of_capsule(PyObject* capsule) {
  auto* held = static_cast<std::shared_ptr<Site>*>(PyCapsule_GetPointer(capsule, kSiteCapsule));
  if (held == nullptr) throw py::error_already_set();
  return **held;
}

void check_arguments(const char* name, Py_ssize_t given, Py_ssize_t expected) {
  if (given != expected) {
    throw std::invalid_argument(std::string(name) + " takes " + std::to_string(expected) +
                                " arguments, got " + std::to_string(given));
  }
}

// A module's call, replayed at its site, recorded in the open mhc_recompute block as the op
// `fn(*op_args, **kwargs)` that returned `output`, where `record` is `(ranges, fn, kwargs)` (the
// block's C++ ranges), not None: what recompute.manager.record_as records after the call.
void record_at_site(PyObject* record, std::initializer_list<PyObject*> op_args,
                    PyObject* output) {
  if (record == Py_None) return;
  if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) != 3) {
    throw std::invalid_argument("the module call's record must be (ranges, fn, kwargs) or None");
  }
  BlockOutputs* block = block_outputs_of(PyTuple_GET_ITEM(record, 0));
  if (block == nullptr) {
    throw std::invalid_argument("the module call's record names no mhc_recompute block ranges");
  }
  py::tuple packed(op_args.size());
  size_t i = 0;
  for (PyObject* a : op_args) packed[i++] = py::reinterpret_borrow<py::object>(a);
  block->record(PyTuple_GET_ITEM(record, 1), packed, PyTuple_GET_ITEM(record, 2), output);
}

// pre_fast(site, x, phi, alpha, bias, main_grads, params, record): pre at the module's call
// site, the link made here from x (where x needs a gradient): (y, h_pre, h_post, h_res), or
// None where the call is not one the site replays (the module then takes the op's Python path).
// main_grads: a sequence of the parameters' main_grad buffers, or None; params: with them, the
// parameters (to flag); record: None, or (ranges, fn, kwargs) to record the call in the open
// mhc_recompute block as fn(x, h_pre, **kwargs) returning y (record_at_site).
PyObject* pre_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  check_arguments("pre_fast", nargs, 8);
  const Site& site = site_of_capsule(args[0]);
  for (int i = 1; i < 5; ++i) {
    if (!plain_tensor(args[i])) Py_RETURN_NONE;
  }
  const at::Tensor &x = THPVariable_Unpack(args[1]), &phi = THPVariable_Unpack(args[2]),
                   &alpha = THPVariable_Unpack(args[3]), &bias = THPVariable_Unpack(args[4]);
  if (!records({&x, &phi, &alpha, &bias}) || !site.matches({&x, &phi, &alpha, &bias})) {
    Py_RETURN_NONE;
  }
  std::vector<at::Tensor> main_grads;
  py::object params = py::none();
  if (args[5] != Py_None) {
    main_grads = py::handle(args[5]).cast<std::vector<at::Tensor>>();
    params = py::reinterpret_borrow<py::object>(args[6]);
  }
  std::vector<at::Tensor> outs =
      pre_apply(site.table, x, phi, alpha, bias, site.scratch,
                x.requires_grad() ? std::make_shared<Link>(x) : nullptr, std::move(main_grads),
                std::move(params));
  py::tuple tuple(4);
  for (Py_ssize_t i = 0; i < 4; ++i) {
    PyObject* wrapped = THPVariable_Wrap(outs[i]);
    if (wrapped == nullptr) return nullptr;
    PyTuple_SET_ITEM(tuple.ptr(), i, wrapped);
  }
  record_at_site(args[7], {args[1], PyTuple_GET_ITEM(tuple.ptr(), 1)},
                 PyTuple_GET_ITEM(tuple.ptr(), 0));
  return tuple.release().ptr();
  END_HANDLE_TH_ERRORS
}

// combine_fast(site, x, f, f_bias or None, h_res, h_post, record): the combine at the module's
// call site on the mappings of one of our pre nodes (h_res's grad_fn), taking that pre's link
// where x is its x: x', or None where the call is not one the site replays or the mappings come
// from elsewhere (a Python autograd function's, whose link the op's Python path finds); record:
// None, or (ranges, fn, kwargs) to record the call in the open mhc_recompute block as
// fn(x, f, f_bias, h_res, h_post, **kwargs) returning x' (record_at_site).
PyObject* combine_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  check_arguments("combine_fast", nargs, 7);
  const Site& site = site_of_capsule(args[0]);
  for (int i = 1; i < 6; ++i) {
    if (!(i == 3 && args[i] == Py_None) && !plain_tensor(args[i])) Py_RETURN_NONE;
  }
  const at::Tensor &x = THPVariable_Unpack(args[1]), &f = THPVariable_Unpack(args[2]),
                   &h_res = THPVariable_Unpack(args[4]), &h_post = THPVariable_Unpack(args[5]);
  const at::Tensor bias = args[3] == Py_None ? at::Tensor() : THPVariable_Unpack(args[3]);
  if (!records({&x, &f, &bias, &h_res, &h_post}) ||
      !site.matches({&x, &f, &bias, &h_res, &h_post})) {
    Py_RETURN_NONE;
  }
  const PreBackward* pre = pre_node_of(h_res);
  if (pre == nullptr) Py_RETURN_NONE;
  std::shared_ptr<Link> link = pre->link_ && pre->link_->claim(x) ? pre->link_ : nullptr;
  std::optional<at::Tensor> f_bias;
  if (bias.defined()) f_bias = bias;
  py::object out = py::reinterpret_steal<py::object>(
      THPVariable_Wrap(combine_apply(site.table, x, f, f_bias, h_res, h_post, std::move(link))));
  if (!out) return nullptr;
  record_at_site(args[6], {args[1], args[2], args[3], args[4], args[5]}, out.ptr());
  return out.release().ptr();
  END_HANDLE_TH_ERRORS
}

PyMethodDef fast_calls[] = {
    {"pre_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(pre_fast)),
     METH_FASTCALL, "pre at a module's call site, or None"},
    {"combine_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(combine_fast)),
     METH_FASTCALL, "the combine at a module's call site, or None"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void bind_autograd_nodes(py::module& m) {
  py::class_<OpTable, std::shared_ptr<OpTable>>(m, "OpTable")
      .def(py::init<int64_t, int64_t, py::object>(), py::arg("forward_recipe"),
           py::arg("device"), py::arg("python_backward"))
      .def("backward_recipes", &OpTable::size, "how many backward recipes the table holds");
  py::class_<Link, std::shared_ptr<Link>>(m, "Link")
      .def(py::init<const at::Tensor&>(), py::arg("x"))
      .def("claim", &Link::claim, py::arg("x"))
      .def_readonly("claimed", &Link::claimed)
      .def("park", &Link::park)
      .def("take", [](Link& link) -> py::object {
        at::Tensor g, h_res;
        if (!link.take(g, h_res)) return py::none();
        return py::make_tuple(g, h_res);
      });
  py::class_<Site, std::shared_ptr<Site>>(m, "Site")
      .def(py::init<std::shared_ptr<OpTable>, std::vector<at::Tensor>,
                    const std::vector<std::optional<at::Tensor>>&>(),
           py::arg("table"), py::arg("scratch"), py::arg("operands"))
      .def("capsule", &site_capsule, "the site in a capsule, as pre_fast and combine_fast take it");
  m.def("pre_site_apply", &pre_site_apply,
        "pre's forward at a call site, or None where its operands do not match the site");
  m.def("combine_site_apply", &combine_site_apply,
        "the combine's forward at a call site, or None where its operands do not match");
  m.def("pre_apply", &pre_apply, "pre's forward replayed, with a C++ autograd node");
  m.def(
      "node_link",
      [](const at::Tensor& h_res) -> std::shared_ptr<Link> {
        const PreBackward* pre = pre_node_of(h_res);
        return pre == nullptr ? nullptr : pre->link_;
      },
      py::arg("h_res"), "the link of the pre node h_res comes from, or None");
  m.def("combine_apply", &combine_apply, "combine's forward replayed, with a C++ autograd node");
  m.def(
      "node_storage",
      [] {
        return py::make_tuple(NodeStorage<PreBackward>::free_blocks(),
                              NodeStorage<CombineBackward>::free_blocks());
      },
      "the freed pre and combine nodes' blocks held for reuse (pre's, the combine's)");
  py::module torch_module = py::module::import("torch");
  tensor_type = reinterpret_cast<PyTypeObject*>(  // (held for the process's lifetime)
      py::object(torch_module.attr("Tensor")).release().ptr());
  parameter_type = reinterpret_cast<PyTypeObject*>(
      py::object(py::module::import("torch.nn").attr("Parameter")).release().ptr());
  for (PyMethodDef* def = fast_calls; def->ml_name != nullptr; ++def) {
    PyObject* fn = PyCFunction_NewEx(def, nullptr, nullptr);
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def->ml_name, py::reinterpret_steal<py::object>(fn));
  }
}

}  // namespace mhc
