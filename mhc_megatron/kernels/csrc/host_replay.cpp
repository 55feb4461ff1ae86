// The host side of one mHC op call, replayed: allocate its tensors and launch its Triton kernels
// as a recorded call did (mhc_megatron/kernels/host_replay.py). Built on first use with
// torch.utils.cpp_extension; the CUDA driver's calls (cuLaunchKernel ...) are looked up in libcuda
// at run time, so the build needs torch's headers and a C++ compiler only.
#include "host_replay.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <cstring>
#include <vector>

namespace {

// The CUDA driver calls the replay makes, looked up in libcuda once.
struct Driver {
  int (*launch_kernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, void*, void**, void**);
  int (*stream_is_capturing)(void*, int*);
  int (*ctx_get_current)(void**);
  int (*ctx_set_current)(void*);
  int (*device_get)(int*, int);
  int (*primary_ctx_retain)(void**, int);
};

template <class F>
void lookup(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  TORCH_CHECK(fn != nullptr, "mHC host replay: no ", name, " in libcuda.so.1");
}

const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(lib != nullptr, "mHC host replay: libcuda.so.1 is not loaded");
    Driver r;
    lookup(lib, "cuLaunchKernel", r.launch_kernel);
    lookup(lib, "cuStreamIsCapturing", r.stream_is_capturing);
    lookup(lib, "cuCtxGetCurrent", r.ctx_get_current);
    lookup(lib, "cuCtxSetCurrent", r.ctx_set_current);
    lookup(lib, "cuDeviceGet", r.device_get);
    lookup(lib, "cuDevicePrimaryCtxRetain", r.primary_ctx_retain);
    return r;
  }();
  return d;
}

// Makes the device's primary context (the one torch's runtime calls use) current on this
// thread where none is: a thread that has made no CUDA runtime call yet, such as autograd's
// device thread (torch sets its device only where cudaGetDevice differs, which binds no
// context), has none, and the driver's calls need one.
void ensure_context(int64_t device) {
  const Driver& d = driver();
  void* ctx = nullptr;
  int error = d.ctx_get_current(&ctx);
  TORCH_CHECK(error == 0, "mHC host replay: cuCtxGetCurrent failed (CUresult ", error, ")");
  if (ctx != nullptr) return;
  int handle = 0;
  error = d.device_get(&handle, static_cast<int>(device));
  if (error == 0) error = d.primary_ctx_retain(&ctx, handle);
  if (error == 0) error = d.ctx_set_current(ctx);
  TORCH_CHECK(error == 0, "mHC host replay: could not make device ", device,
              "'s primary context current (CUresult ", error, ")");
}

// Where a kernel parameter's value comes from (host_replay.py: ARG_KINDS).
enum Kind : int64_t { INPUT = 0, ALLOCATED = 1, SCRATCH = 2, I32 = 3, I64 = 4, F32 = 5, NULLPTR = 6 };

constexpr size_t kMaxParams = 64;

struct Launch {
  uint64_t function;
  unsigned grid_x, grid_y, grid_z, block, shared;
  std::vector<int64_t> kinds, values;
};

struct Recipe {
  int64_t inputs, scratch;
  std::vector<std::vector<int64_t>> sizes;  // the allocated tensors, contiguous
  std::vector<at::ScalarType> dtypes;
  // Where each allocated tensor lives: its own allocation (group -1), or a byte offset into a
  // shared one (several small tensors of one lifetime: one allocation instead of several)
  std::vector<int64_t> group, offset;
  std::vector<int64_t> group_bytes;
  std::vector<int64_t> returned;  // which allocated tensors run() returns, in order
  std::vector<Launch> launches;
};

std::vector<Recipe>& recipes() {
  static std::vector<Recipe> all;
  return all;
}

}  // namespace

int64_t add_recipe(int64_t inputs, int64_t scratch, std::vector<std::vector<int64_t>> sizes,
                   std::vector<int64_t> dtypes, std::vector<int64_t> group,
                   std::vector<int64_t> offset, std::vector<int64_t> group_bytes,
                   std::vector<int64_t> returned,
                   std::vector<std::vector<int64_t>> geometry,  // function, grid x/y/z, block, shared
                   std::vector<std::vector<int64_t>> kinds, std::vector<std::vector<int64_t>> values) {
  TORCH_CHECK(sizes.size() == dtypes.size() && sizes.size() == group.size() &&
              sizes.size() == offset.size() && geometry.size() == kinds.size() &&
              kinds.size() == values.size(), "mHC host replay: inconsistent recipe");
  Recipe r;
  r.inputs = inputs;
  r.scratch = scratch;
  r.sizes = std::move(sizes);
  for (int64_t d : dtypes) r.dtypes.push_back(static_cast<at::ScalarType>(d));
  for (size_t i = 0; i < group.size(); ++i) {
    const int64_t g = group[i];
    TORCH_CHECK(g >= -1 && g < (int64_t)group_bytes.size(), "mHC host replay: bad group");
    if (g >= 0) {
      int64_t numel = 1;
      for (int64_t d : r.sizes[i]) numel *= d;
      TORCH_CHECK(offset[i] >= 0 && offset[i] % 16 == 0 &&
                  offset[i] + numel * (int64_t)c10::elementSize(r.dtypes[i]) <= group_bytes[g],
                  "mHC host replay: a grouped tensor outside its allocation");
    }
  }
  r.group = std::move(group);
  r.offset = std::move(offset);
  r.group_bytes = std::move(group_bytes);
  for (int64_t i : returned) TORCH_CHECK(i >= 0 && i < (int64_t)r.sizes.size());
  r.returned = std::move(returned);
  for (size_t i = 0; i < geometry.size(); ++i) {
    TORCH_CHECK(geometry[i].size() == 6 && kinds[i].size() == values[i].size() &&
                kinds[i].size() <= kMaxParams, "mHC host replay: bad launch in recipe");
    Launch l;
    l.function = static_cast<uint64_t>(geometry[i][0]);
    l.grid_x = geometry[i][1];
    l.grid_y = geometry[i][2];
    l.grid_z = geometry[i][3];
    l.block = geometry[i][4];
    l.shared = geometry[i][5];
    for (size_t j = 0; j < kinds[i].size(); ++j) {
      int64_t k = kinds[i][j], v = values[i][j];
      TORCH_CHECK(k >= INPUT && k <= NULLPTR, "mHC host replay: bad argument kind");
      TORCH_CHECK(k != INPUT || (v >= 0 && v < inputs), "mHC host replay: bad input index");
      TORCH_CHECK(k != SCRATCH || (v >= 0 && v < scratch), "mHC host replay: bad scratch index");
      TORCH_CHECK(k != ALLOCATED || (v >= 0 && v < (int64_t)r.sizes.size()),
                  "mHC host replay: bad allocation index");
    }
    l.kinds = std::move(kinds[i]);
    l.values = std::move(values[i]);
    r.launches.push_back(std::move(l));
  }
  recipes().push_back(std::move(r));
  return static_cast<int64_t>(recipes().size()) - 1;
}

namespace mhc {

bool capturing(void* stream, int64_t device) {
  ensure_context(device);
  int status = 0;
  const int error = driver().stream_is_capturing(stream, &status);
  TORCH_CHECK(error == 0, "mHC host replay: cuStreamIsCapturing failed (CUresult ", error, ")");
  return status != 0;  // CU_STREAM_CAPTURE_STATUS_NONE is 0
}

void* current_stream(int64_t device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)))
      .native_handle();
}

std::vector<at::Tensor> replay(int64_t id, const std::vector<at::Tensor>& inputs,
                               const std::vector<at::Tensor>& scratch, void* stream,
                               int64_t device) {
  const Recipe& r = recipes().at(id);
  TORCH_CHECK((int64_t)inputs.size() == r.inputs && (int64_t)scratch.size() == r.scratch,
              "mHC host replay: a recipe run with other inputs than it was recorded with");
  const auto options = at::TensorOptions().device(at::kCUDA, device);
  std::vector<c10::Storage> groups;
  groups.reserve(r.group_bytes.size());
  for (int64_t bytes : r.group_bytes) {
    groups.push_back(at::empty({bytes}, options.dtype(at::kByte)).storage());
  }
  std::vector<at::Tensor> allocated;
  allocated.reserve(r.sizes.size());
  for (size_t i = 0; i < r.sizes.size(); ++i) {
    if (r.group[i] < 0) {
      allocated.push_back(at::empty(r.sizes[i], options.dtype(r.dtypes[i])));
      continue;
    }
    // a tensor of its own (no view, no autograd history) on the shared allocation, as
    // at::empty builds one on a fresh allocation
    auto t = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(groups[r.group[i]]), c10::DispatchKeySet(c10::DispatchKey::CUDA),
        c10::scalarTypeToTypeMeta(r.dtypes[i]));
    auto* impl = t.unsafeGetTensorImpl();
    impl->set_sizes_contiguous(r.sizes[i]);
    impl->set_storage_offset(r.offset[i] / (int64_t)c10::elementSize(r.dtypes[i]));
    allocated.push_back(std::move(t));
  }
  ensure_context(device);
  const auto launch = driver().launch_kernel;
  uint64_t slots[kMaxParams];
  void* params[kMaxParams];
  for (const Launch& l : r.launches) {
    for (size_t j = 0; j < l.kinds.size(); ++j) {
      const int64_t v = l.values[j];
      slots[j] = 0;
      switch (l.kinds[j]) {
        case INPUT: slots[j] = reinterpret_cast<uint64_t>(inputs[v].data_ptr()); break;
        case ALLOCATED: slots[j] = reinterpret_cast<uint64_t>(allocated[v].data_ptr()); break;
        case SCRATCH: slots[j] = reinterpret_cast<uint64_t>(scratch[v].data_ptr()); break;
        case I32: { const int32_t x = static_cast<int32_t>(v); std::memcpy(&slots[j], &x, 4); break; }
        case I64: slots[j] = static_cast<uint64_t>(v); break;
        case F32: { const uint32_t x = static_cast<uint32_t>(v); std::memcpy(&slots[j], &x, 4); break; }
        default: break;  // NULLPTR
      }
      params[j] = &slots[j];
    }
    const int status = launch(reinterpret_cast<void*>(l.function), l.grid_x, l.grid_y, l.grid_z,
                              l.block, 1, 1, l.shared, stream, params,
                              nullptr);
    TORCH_CHECK(status == 0, "mHC host replay: cuLaunchKernel failed (CUresult ", status, ")");
  }
  std::vector<at::Tensor> out;
  out.reserve(r.returned.size());
  for (int64_t i : r.returned) out.push_back(allocated[i]);
  return out;
}

}  // namespace mhc

std::vector<at::Tensor> run(int64_t id, const std::vector<at::Tensor>& inputs,
                            const std::vector<at::Tensor>& scratch, int64_t stream,
                            int64_t device) {
  return mhc::replay(id, inputs, scratch, reinterpret_cast<void*>(stream), device);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_recipe", &add_recipe, "register a recorded op call; returns its id");
  m.def("run", &run, "allocate and launch as recipe `id` records; returns the returned tensors");
  mhc::bind_autograd_nodes(m);
  mhc::bind_saved_ranges(m);
}
