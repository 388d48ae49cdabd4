// Runs `main` of an exported Relax VM library on the CPU: the aarch64 side of run_under_qemu.
//
//   vm_host LIBRARY OUT_DIR [INPUT.npy ...]
//
// Inputs are .npy files (C order, little-endian) as numpy.save writes them; every output tensor
// (a tuple is flattened depth-first) is written to OUT_DIR/output_<i>.npy. Errors go to stderr
// with exit status 1. The VM is set up as tvm.runtime.vm.VirtualMachine does it from Python.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using tvm::ffi::Any;
using tvm::ffi::Array;
using tvm::ffi::Function;
using tvm::ffi::Module;
using tvm::ffi::Tensor;

// tvm.runtime.vm.VirtualMachine.POOLED_ALLOCATOR, Python's default.
constexpr int kPooledAllocator = 2;
// TVM's kernels assume 64-byte aligned buffers (kAllocAlignment).
constexpr size_t kAlignment = 64;

struct AlignedAlloc {
  void AllocData(DLTensor* tensor) {
    size_t size = tvm::ffi::GetDataSize(*tensor);
    size = (size + kAlignment - 1) / kAlignment * kAlignment;
    tensor->data = std::aligned_alloc(kAlignment, size == 0 ? kAlignment : size);
    if (tensor->data == nullptr) throw std::runtime_error("out of memory");
  }
  void FreeData(DLTensor* tensor) { std::free(tensor->data); }
};

struct DType {
  const char* descr;  // numpy's type code without the byte-order character
  DLDataType dl;
};

const DType kDTypes[] = {
    {"f4", {kDLFloat, 32, 1}}, {"f8", {kDLFloat, 64, 1}}, {"f2", {kDLFloat, 16, 1}},
    {"i1", {kDLInt, 8, 1}},    {"i2", {kDLInt, 16, 1}},   {"i4", {kDLInt, 32, 1}},
    {"i8", {kDLInt, 64, 1}},   {"u1", {kDLUInt, 8, 1}},   {"u2", {kDLUInt, 16, 1}},
    {"u4", {kDLUInt, 32, 1}},  {"u8", {kDLUInt, 64, 1}},  {"b1", {kDLBool, 8, 1}},
};

DLDataType ParseDescr(const std::string& descr) {
  // '<' little-endian, '|' byte order irrelevant (1 byte); aarch64 Linux is little-endian.
  if (descr.size() == 3 && (descr[0] == '<' || descr[0] == '|')) {
    for (const DType& t : kDTypes) {
      if (descr.compare(1, 2, t.descr) == 0) return t.dl;
    }
  }
  throw std::runtime_error("unsupported npy dtype '" + descr + "'");
}

std::string FormatDescr(DLDataType dtype) {
  for (const DType& t : kDTypes) {
    if (t.dl.code == dtype.code && t.dl.bits == dtype.bits && t.dl.lanes == dtype.lanes) {
      return std::string(dtype.bits == 8 ? "|" : "<") + t.descr;
    }
  }
  throw std::runtime_error("unsupported output dtype " +
                           std::string(tvm::ffi::DLDataTypeToString(dtype)));
}

// The value of `'key': ` in an npy header dict, up to the next ',' (or the closing ')' of a
// shape tuple).
std::string HeaderField(const std::string& header, const std::string& key) {
  size_t pos = header.find("'" + key + "'");
  if (pos == std::string::npos) throw std::runtime_error("npy header lacks '" + key + "'");
  pos = header.find(':', pos) + 1;
  while (header[pos] == ' ') ++pos;
  size_t end = header[pos] == '(' ? header.find(')', pos) + 1 : header.find(',', pos);
  return header.substr(pos, end - pos);
}

std::streamsize DataSize(const Tensor& tensor) {
  return static_cast<std::streamsize>(tvm::ffi::GetDataSize(tensor.numel(), tensor.dtype()));
}

Tensor ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  char magic[8];
  in.read(magic, 8);
  if (!in || std::memcmp(magic, "\x93NUMPY", 6) != 0) {
    throw std::runtime_error(path + " is not an npy file");
  }
  // Version 1 has a 2-byte header length, versions 2 and 3 a 4-byte one.
  uint32_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), magic[6] == 1 ? 2 : 4);
  std::string header(header_len, '\0');
  in.read(header.data(), header_len);

  if (HeaderField(header, "fortran_order") != "False") {
    throw std::runtime_error(path + ": Fortran-ordered arrays are not supported");
  }
  std::string descr = HeaderField(header, "descr");
  DLDataType dtype = ParseDescr(descr.substr(1, descr.size() - 2));
  std::vector<int64_t> shape;
  std::string dims = HeaderField(header, "shape");
  std::istringstream dim_stream(dims.substr(1, dims.size() - 2));
  for (std::string dim; std::getline(dim_stream, dim, ',');) {
    if (dim.find_first_not_of(' ') != std::string::npos) shape.push_back(std::stoll(dim));
  }

  tvm::ffi::ShapeView shape_view(shape.data(), shape.size());
  Tensor tensor = Tensor::FromNDAlloc(AlignedAlloc(), shape_view, dtype, DLDevice{kDLCPU, 0});
  in.read(static_cast<char*>(tensor.data_ptr()), DataSize(tensor));
  if (!in) throw std::runtime_error(path + " is truncated");
  return tensor;
}

void WriteNpy(const std::string& path, const Tensor& tensor) {
  if (tensor.device().device_type != kDLCPU || !tensor.IsContiguous()) {
    throw std::runtime_error("output is not a contiguous CPU tensor");
  }
  // A Python tuple: "()", "(5,)", "(2, 3)".
  std::string shape = "(";
  for (int i = 0; i < tensor.ndim(); ++i) {
    shape += (i > 0 ? ", " : "") + std::to_string(tensor.shape()[i]);
  }
  shape += tensor.ndim() == 1 ? ",)" : ")";
  std::string header = "{'descr': '" + FormatDescr(tensor.dtype()) +
                       "', 'fortran_order': False, 'shape': " + shape + ", }";
  // numpy pads the header with spaces and a newline so that the data starts 64-byte aligned.
  size_t total = 10 + header.size() + 1;
  header.append((kAlignment - total % kAlignment) % kAlignment, ' ');
  header += '\n';

  std::ofstream out(path, std::ios::binary);
  const uint16_t header_len = static_cast<uint16_t>(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  out.write(reinterpret_cast<const char*>(&header_len), 2);
  out << header;
  const char* data = static_cast<const char*>(tensor.data_ptr()) + tensor.byte_offset();
  out.write(data, DataSize(tensor));
  if (!out) throw std::runtime_error("cannot write " + path);
}

// Depth-first over nested tuples, so that the Python side receives a flat list.
void CollectOutputs(const Any& value, std::vector<Tensor>* outputs) {
  if (auto tensor = value.try_cast<Tensor>()) {
    outputs->push_back(*tensor);
  } else if (auto tuple = value.try_cast<Array<Any>>()) {
    for (const Any& item : *tuple) CollectOutputs(item, outputs);
  } else {
    throw std::runtime_error("unsupported output of type " + value.GetTypeKey());
  }
}

Function GetFunction(const Module& module, const std::string& name, bool query_imports) {
  auto function = module->GetFunction(name, query_imports);
  if (!function) throw std::runtime_error("no function " + name + " (not a Relax VM library?)");
  return *function;
}

int Run(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " LIBRARY OUT_DIR [INPUT.npy ...]\n";
    return 2;
  }
  Module library = Module::LoadFromFile(argv[1]);
  // The executable is an import of the library module, hence query_imports.
  Module vm = GetFunction(library, "vm_load_executable", true)().cast<Module>();
  GetFunction(vm, "vm_initialization", false)(static_cast<int>(kDLCPU), 0, kPooledAllocator);

  std::vector<Tensor> inputs;
  for (int i = 3; i < argc; ++i) inputs.push_back(ReadNpy(argv[i]));
  std::vector<tvm::ffi::AnyView> args(inputs.begin(), inputs.end());
  Function main = GetFunction(vm, "main", false);
  Any result;
  main.CallPacked(args.data(), static_cast<int32_t>(args.size()), &result);

  std::vector<Tensor> outputs;
  CollectOutputs(result, &outputs);
  for (size_t i = 0; i < outputs.size(); ++i) {
    WriteNpy(std::string(argv[2]) + "/output_" + std::to_string(i) + ".npy", outputs[i]);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& err) {
    std::cerr << "vm_host: " << err.what() << "\n";
    return 1;
  }
}
