// Tensor views over DLPack: how tensors cross into native code without libtorch.
//
// TensorView::from(obj, op, arg) calls obj.__dlpack__() (versioned capsule when the
// producer supports it, legacy otherwise), keeps the managed tensor alive for the
// view's lifetime and releases it in the destructor. Checks raise Python exceptions
// that name the op, the argument, the expected and the actual value, e.g.
//   verify: draft_probs must be float32 [B, K, V] = [4, 5, 49152], got bfloat16 [4, 5, 49152]
#pragma once

#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace verispec {
namespace py = pybind11;

enum class DType { kFloat32, kFloat16, kBFloat16, kFloat64, kInt32, kInt64, kUInt8, kBool, kOther };
const char* dtype_name(DType d);

enum class DeviceKind { kCPU, kCUDA, kOther };

// One dimension of an expected shape: a symbol for messages and a value
// (kAnyDim accepts any size).
constexpr int64_t kAnyDim = -1;
struct Dim {
  const char* name;
  int64_t value;
};

class TensorView {
 public:
  // Imports `obj` through DLPack. `writable` requests a tensor the op may write
  // (read-only versioned tensors are rejected).
  static TensorView from(const py::handle& obj, const char* op, const char* arg,
                         bool writable = false);
  // How `from` imports obj: "c_exchange_api" (the type's DLPack C exchange API, no
  // Python call) or "__dlpack__".
  static const char* import_path(const py::handle& obj);
  // Whether the build's DLPack header (>= 1.3) lets `from` use C exchange APIs at all.
  static bool exchange_api_compiled();
  TensorView(TensorView&& other) noexcept;
  TensorView& operator=(TensorView&&) = delete;
  TensorView(const TensorView&) = delete;
  ~TensorView();

  DType dtype() const { return dtype_; }
  DeviceKind device_kind() const { return device_kind_; }
  int device_id() const { return device_id_; }
  std::string device_str() const;
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const { return shape_.at(static_cast<size_t>(d)); }
  int64_t stride(int64_t d) const { return strides_.at(static_cast<size_t>(d)); }
  int64_t numel() const;
  const std::vector<int64_t>& shape() const { return shape_; }
  std::string shape_str() const;
  const char* op() const { return op_; }
  const char* arg() const { return arg_; }

  template <typename T>
  T* data() const { return static_cast<T*>(data_); }
  void* raw_data() const { return data_; }

  // dtype in `dtypes` and shape matching `shape` (rank and every fixed dim).
  const TensorView& expect(std::initializer_list<DType> dtypes,
                           std::initializer_list<Dim> shape) const;
  // Same device as `other` (names it in the message).
  const TensorView& expect_same_device(const TensorView& other) const;
  const TensorView& expect_cpu() const;
  // Row-major contiguous.
  const TensorView& expect_contiguous() const;
  // Innermost dimension contiguous (stride 1); outer strides may be anything >= 0.
  const TensorView& expect_last_dim_contiguous() const;

 private:
  TensorView() = default;
  [[noreturn]] void fail(const std::string& what) const;
  void release() noexcept;
  // The checks of a versioned import (major version; writable when asked).
  void check_versioned(bool writable) const;
  // Fills data, dtype, device, shape and strides from the imported DLTensor.
  void describe_from(const DLTensor& t);

  const char* op_ = "";
  const char* arg_ = "";
  void* data_ = nullptr;
  DType dtype_ = DType::kOther;
  std::string dtype_desc_;
  DeviceKind device_kind_ = DeviceKind::kOther;
  int device_id_ = 0;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  // Exactly one of these owns the import while the view lives.
  DLManagedTensorVersioned* versioned_ = nullptr;
  DLManagedTensor* legacy_ = nullptr;
};

// The check every op does on a sequence of tensors that must share a device.
void expect_same_device(std::initializer_list<const TensorView*> views);

}  // namespace verispec
