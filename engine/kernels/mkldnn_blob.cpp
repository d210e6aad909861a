// oneDNN-packed weights as plain bytes and back, so a packed bf16 layer can be stored once and restored
// by one memory copy (engine/morph/packed_store.py) instead of being re-packed from plain rows.
//
//   mkldnn_to_blob(packed)                -> uint8 [nbytes]: a copy of the packed tensor's bytes
//   mkldnn_from_blob(blob, md, sizes, dt) -> an mkldnn tensor whose data IS `blob` (no copy); `md` is
//                                            the serialized oneDNN descriptor (mkldnn._get_mkldnn_serialized_md)
//
// The tensor from mkldnn_from_blob does not own its memory (torch's own loader for AOT-compiled packed
// weights makes it the same way): the caller keeps `blob` alive as long as the tensor (PackedGroup holds
// both). The functions used are ATen's, exported by libtorch_cpu but declared in a header torch does not
// ship, hence the declarations below.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace at::native {
void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
at::Tensor mkldnn_tensor_from_data_ptr(void* data_ptr, at::IntArrayRef dims, at::ScalarType dtype, at::Device device,
                                       const uint8_t* opaque_metadata, int64_t opaque_metadata_size);
}  // namespace at::native

static at::Tensor mkldnn_to_blob(const at::Tensor& packed) {
  TORCH_CHECK(packed.is_mkldnn(), "mkldnn_to_blob needs an mkldnn tensor");
  const int64_t n = at::native::nbytes_from_mkldnn(packed);
  auto blob = at::empty({n}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(blob.data_ptr<uint8_t>(), at::native::data_ptr_from_mkldnn(packed), static_cast<size_t>(n));
  return blob;
}

static at::Tensor mkldnn_from_blob(const at::Tensor& blob, const at::Tensor& md, at::IntArrayRef sizes,
                                   at::ScalarType dtype) {
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.dim() == 1 && blob.is_contiguous(), "blob must be contiguous uint8 [n]");
  TORCH_CHECK(md.scalar_type() == at::kByte && md.dim() == 1 && md.is_contiguous(), "md must be contiguous uint8 [m]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(blob.data_ptr()) % 64 == 0, "blob must be 64-byte aligned");
  auto out = at::native::mkldnn_tensor_from_data_ptr(blob.data_ptr(), sizes, dtype, blob.device(),
                                                     md.data_ptr<uint8_t>(), md.numel());
  TORCH_CHECK(at::native::nbytes_from_mkldnn(out) == blob.numel(), "the descriptor needs ",
              at::native::nbytes_from_mkldnn(out), " bytes, the blob holds ", blob.numel());
  return out;
}

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("mkldnn_to_blob(Tensor packed) -> Tensor");
  m.def("mkldnn_from_blob(Tensor blob, Tensor md, int[] sizes, ScalarType dtype) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("mkldnn_from_blob", &mkldnn_from_blob); }
TORCH_LIBRARY_IMPL(morphserve, MkldnnCPU, m) { m.impl("mkldnn_to_blob", &mkldnn_to_blob); }
