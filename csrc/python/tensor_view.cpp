#include "tensor_view.h"

#include <Python.h>

#include <string>
#include <unordered_map>
#include <utility>

namespace verispec {
namespace {

constexpr const char* kVersionedName = "dltensor_versioned";
constexpr const char* kLegacyName = "dltensor";

DType to_dtype(const DLDataType& t) {
  if (t.lanes != 1) return DType::kOther;
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 32) return DType::kFloat32;
      if (t.bits == 16) return DType::kFloat16;
      if (t.bits == 64) return DType::kFloat64;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::kBFloat16;
      break;
    case kDLInt:
      if (t.bits == 32) return DType::kInt32;
      if (t.bits == 64) return DType::kInt64;
      break;
    case kDLUInt:
      if (t.bits == 8) return DType::kUInt8;
      break;
    case kDLBool:
      return DType::kBool;
    default:
      break;
  }
  return DType::kOther;
}

// Messages are built with std::string and std::to_string, not iostreams: an ostream's
// number formatting goes through locale facets, and on a CUDA machine (torch 2.11,
// gcc 13) formatting an int into an error message segfaulted inside the facet call:
// the process's libstdc++ pieces did not match. std::to_string needs no locale.
std::string describe(const DLDataType& t) {
  return "dlpack(code=" + std::to_string(int(t.code)) + ", bits=" + std::to_string(int(t.bits)) +
         ", lanes=" + std::to_string(t.lanes) + ")";
}

std::string join(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The DLPack C exchange API of a tensor type (DLPack >= 1.3: `__dlpack_c_exchange_api__`,
// a "dlpack_exchange_api" capsule on the type; torch >= 2.10 has one), or null. It turns a
// tensor into a DLManagedTensorVersioned in C, without the Python-level __dlpack__ and
// __dlpack_device__ calls (~13 us a tensor with torch, most of a small op's call).
// Looked up once per type (under the GIL); the cache holds a reference to each type so
// that a key's address is never reused by another.
#if DLPACK_MAJOR_VERSION == 1 && DLPACK_MINOR_VERSION >= 3
#define VERISPEC_DLPACK_EXCHANGE_API 1
const DLPackExchangeAPI* exchange_api(PyTypeObject* type) {
  static std::unordered_map<PyTypeObject*, const DLPackExchangeAPI*> cache;
  const auto found = cache.find(type);
  if (found != cache.end()) return found->second;
  const DLPackExchangeAPI* api = nullptr;
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type),
                                             "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_IsValid(capsule, "dlpack_exchange_api")) {
      const auto* a = static_cast<const DLPackExchangeAPI*>(
          PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
      if (a != nullptr && a->header.version.major == DLPACK_MAJOR_VERSION &&
          a->managed_tensor_from_py_object_no_sync != nullptr) {
        api = a;  // the producer keeps the table alive for the whole process
      }
    }
    Py_DECREF(capsule);
  }
  Py_INCREF(reinterpret_cast<PyObject*>(type));
  cache.emplace(type, api);
  return api;
}
#else
#define VERISPEC_DLPACK_EXCHANGE_API 0  // a pre-1.3 header: __dlpack__ only
#endif

}  // namespace

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
    default: return "unsupported dtype";
  }
}

TensorView TensorView::from(const py::handle& obj, const char* op, const char* arg,
                            bool writable) {
  TensorView v;
  v.op_ = op;
  v.arg_ = arg;
  DLTensor* t = nullptr;
#if VERISPEC_DLPACK_EXCHANGE_API
  if (const DLPackExchangeAPI* api = exchange_api(Py_TYPE(obj.ptr()))) {
    // What __dlpack__ refuses, refused here too: the ops are not differentiable, and an
    // output written behind autograd's back would be wrong.
    PyObject* grad = PyObject_GetAttrString(obj.ptr(), "requires_grad");
    if (grad == nullptr) PyErr_Clear();
    const int needs_grad = grad != nullptr ? PyObject_IsTrue(grad) : 0;
    Py_XDECREF(grad);
    if (needs_grad != 0) {
      if (needs_grad < 0) PyErr_Clear();
      PyErr_SetString(PyExc_BufferError,
                      (std::string(op) + ": " + arg +
                       " requires grad; the ops are not differentiable: pass tensor.detach()")
                          .c_str());
      throw py::error_already_set();
    }
    // No stream synchronisation, as with stream=-1 below.
    DLManagedTensorVersioned* m = nullptr;
    if (api->managed_tensor_from_py_object_no_sync(obj.ptr(), &m) != 0 || m == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw py::type_error(std::string(op) + ": " + arg + " could not be exported through DLPack");
    }
    v.versioned_ = m;
    t = &m->dl_tensor;
    v.check_versioned(writable);
    v.describe_from(*t);
    return v;
  }
#endif
  if (!py::hasattr(obj, "__dlpack__") || !py::hasattr(obj, "__dlpack_device__")) {
    throw py::type_error(std::string(op) + ": " + arg +
                         " must be a tensor supporting __dlpack__ (e.g. torch.Tensor), "
                         "got " + std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  py::tuple dev = obj.attr("__dlpack_device__")();
  const int dev_type = dev[0].cast<int>();
  // CUDA producers are asked not to synchronise (stream=-1): verispec launches on the
  // stream the caller passes explicitly, ordered after the producer's work.
  py::object stream = dev_type == kDLCUDA ? py::object(py::int_(-1)) : py::object(py::none());
  py::object capsule;
  try {
    capsule = obj.attr("__dlpack__")(py::arg("stream") = stream,
                                      py::arg("max_version") = py::make_tuple(1, 0));
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError)) throw;
    capsule = obj.attr("__dlpack__")(py::arg("stream") = stream);  // pre-1.0 producer
  }
  PyObject* cap = capsule.ptr();
  if (PyCapsule_IsValid(cap, kVersionedName)) {
    v.versioned_ = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, kVersionedName));
    PyCapsule_SetName(cap, "used_dltensor_versioned");
    t = &v.versioned_->dl_tensor;
    v.check_versioned(writable);
  } else if (PyCapsule_IsValid(cap, kLegacyName)) {
    v.legacy_ = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, kLegacyName));
    PyCapsule_SetName(cap, "used_dltensor");
    t = &v.legacy_->dl_tensor;
  } else {
    throw py::type_error(std::string(op) + ": " + arg +
                         ".__dlpack__() returned something that is not a DLPack capsule");
  }
  v.describe_from(*t);
  return v;
}

const char* TensorView::import_path(const py::handle& obj) {
#if VERISPEC_DLPACK_EXCHANGE_API
  if (exchange_api(Py_TYPE(obj.ptr())) != nullptr) return "c_exchange_api";
#else
  (void)obj;
#endif
  return "__dlpack__";
}

bool TensorView::exchange_api_compiled() { return VERISPEC_DLPACK_EXCHANGE_API != 0; }

void TensorView::check_versioned(bool writable) const {
  if (versioned_->version.major != DLPACK_MAJOR_VERSION) {
    fail("uses DLPack major version " + std::to_string(versioned_->version.major) +
         ", verispec understands " + std::to_string(DLPACK_MAJOR_VERSION));
  }
  if (writable && (versioned_->flags & DLPACK_FLAG_BITMASK_READ_ONLY)) {
    fail("must be writable, got a read-only tensor");
  }
}

void TensorView::describe_from(const DLTensor& dl) {
  const DLTensor* t = &dl;
  TensorView& v = *this;
  v.data_ = static_cast<char*>(t->data) + t->byte_offset;
  v.dtype_ = to_dtype(t->dtype);
  v.dtype_desc_ = v.dtype_ == DType::kOther ? describe(t->dtype) : dtype_name(v.dtype_);
  v.device_kind_ = t->device.device_type == kDLCPU ? DeviceKind::kCPU
                   : t->device.device_type == kDLCUDA ? DeviceKind::kCUDA
                                                       : DeviceKind::kOther;
  v.device_id_ = t->device.device_id;
  v.shape_.assign(t->shape, t->shape + t->ndim);
  v.strides_.resize(static_cast<size_t>(t->ndim));
  if (t->strides != nullptr) {
    v.strides_.assign(t->strides, t->strides + t->ndim);
  } else {
    int64_t s = 1;
    for (int d = t->ndim - 1; d >= 0; --d) {
      v.strides_[static_cast<size_t>(d)] = s;
      s *= t->shape[d];
    }
  }
  if (v.device_kind_ == DeviceKind::kOther) {
    v.fail("must be on cpu or cuda, got DLPack device type " +
           std::to_string(int(t->device.device_type)));
  }
}

TensorView::TensorView(TensorView&& o) noexcept
    : op_(o.op_), arg_(o.arg_), data_(o.data_), dtype_(o.dtype_),
      dtype_desc_(std::move(o.dtype_desc_)), device_kind_(o.device_kind_),
      device_id_(o.device_id_), shape_(std::move(o.shape_)),
      strides_(std::move(o.strides_)), versioned_(o.versioned_), legacy_(o.legacy_) {
  o.versioned_ = nullptr;
  o.legacy_ = nullptr;
}

void TensorView::release() noexcept {
  if (versioned_ != nullptr && versioned_->deleter != nullptr) versioned_->deleter(versioned_);
  if (legacy_ != nullptr && legacy_->deleter != nullptr) legacy_->deleter(legacy_);
  versioned_ = nullptr;
  legacy_ = nullptr;
}

TensorView::~TensorView() { release(); }

void TensorView::fail(const std::string& what) const {
  throw py::value_error(std::string(op_) + ": " + arg_ + " " + what);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

std::string TensorView::shape_str() const { return join(shape_); }

std::string TensorView::device_str() const {
  if (device_kind_ == DeviceKind::kCPU) return "cpu";
  return "cuda:" + std::to_string(device_id_);
}

const TensorView& TensorView::expect(std::initializer_list<DType> dtypes,
                                     std::initializer_list<Dim> shape) const {
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok = dtype_ok || d == dtype_;
  bool shape_ok = static_cast<int64_t>(shape.size()) == ndim();
  if (shape_ok) {
    size_t i = 0;
    for (const Dim& d : shape) {
      if (d.value != kAnyDim && d.value != shape_[i]) shape_ok = false;
      ++i;
    }
  }
  if (dtype_ok && shape_ok) return *this;
  std::string s = "must be ";
  size_t i = 0;
  for (DType d : dtypes) s += std::string(i++ ? " or " : "") + dtype_name(d);
  s += " [";
  i = 0;
  bool any_fixed = false;
  for (const Dim& d : shape) {
    s += std::string(i++ ? ", " : "") + d.name;
    any_fixed = any_fixed || d.value != kAnyDim;
  }
  s += "]";
  if (any_fixed) {
    s += " = [";
    i = 0;
    for (const Dim& d : shape) {
      s += i++ ? ", " : "";
      s += d.value == kAnyDim ? std::string("?") : std::to_string(d.value);
    }
    s += "]";
  }
  s += ", got " + dtype_desc_ + " " + shape_str();
  fail(s);
}

const TensorView& TensorView::expect_same_device(const TensorView& other) const {
  if (device_kind_ != other.device_kind_ || device_id_ != other.device_id_) {
    fail("must be on the same device as " + std::string(other.arg_) + " (" +
         other.device_str() + "), got " + device_str());
  }
  return *this;
}

const TensorView& TensorView::expect_cpu() const {
  if (device_kind_ != DeviceKind::kCPU) fail("must be on cpu, got " + device_str());
  return *this;
}

const TensorView& TensorView::expect_contiguous() const {
  int64_t s = 1;
  for (int64_t d = ndim() - 1; d >= 0; --d) {
    if (shape_[static_cast<size_t>(d)] != 1 && strides_[static_cast<size_t>(d)] != s) {
      fail("must be contiguous, got shape " + shape_str() + " with strides " +
           join(strides_));
    }
    s *= shape_[static_cast<size_t>(d)];
  }
  return *this;
}

const TensorView& TensorView::expect_last_dim_contiguous() const {
  bool ok = true;
  if (ndim() > 0 && shape_.back() > 1 && strides_.back() != 1) ok = false;
  for (int64_t st : strides_) ok = ok && st >= 0;
  if (!ok) {
    fail("must have a contiguous last dimension and non-negative strides, got strides " +
         join(strides_));
  }
  return *this;
}

void expect_same_device(std::initializer_list<const TensorView*> views) {
  const TensorView* first = nullptr;
  for (const TensorView* v : views) {
    if (v == nullptr) continue;
    if (first == nullptr) first = v; else v->expect_same_device(*first);
  }
}

}  // namespace verispec
