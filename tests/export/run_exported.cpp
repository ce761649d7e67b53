// attnkit_run_exported DIR: runs every TorchScript file DIR/NAME.model.pt
// (torch.jit.save of a traced or scripted model built from attnkit's
// modules) on the tensors of DIR/NAME.inputs.pt (a tuple, torch.save: libtorch's
// unpickler reads no list that Python pickled) and
// writes its outputs to DIR/NAME.outputs.pt (a list, for torch.load).
// tests/python/test_export.py writes the files and compares the outputs with
// the eager model's: the C++ half of "exports and runs in C++".
//
// It is also the smallest deployment program: torch::jit::load finds the
// attnkit ops and classes of a saved model once libattnkit is loaded, which
// any call into it guarantees (here attnkit::version(); a program that calls
// none links libattnkit with --no-as-needed instead, docs/API.md).
#include <attnkit/runtime.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/script.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

std::vector<char> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

/// A model's output (a tensor, or a tuple or list of them) as a list.
c10::List<at::Tensor> as_list(const c10::IValue& output, const std::string& name) {
  c10::List<at::Tensor> list;
  if (output.isTensor()) {
    list.push_back(output.toTensor());
  } else if (output.isTuple()) {
    for (const auto& item : output.toTupleRef().elements()) list.push_back(item.toTensor());
  } else if (output.isTensorList()) {
    list = output.toTensorList();
  } else {
    throw std::runtime_error(name + ": the output is " + output.tagKind() + ", not tensors");
  }
  return list;
}

void run(const fs::path& model_path) {
  const std::string file = model_path.filename().string();
  const std::string name = file.substr(0, file.size() - std::string(".model.pt").size());
  const fs::path dir = model_path.parent_path();
  torch::jit::Module model = torch::jit::load(model_path.string());
  model.eval();
  const c10::IValue saved = torch::jit::pickle_load(read_file(dir / (name + ".inputs.pt")));
  if (!saved.isTuple()) throw std::runtime_error(name + ": the inputs file holds no tuple");
  const auto& elements = saved.toTupleRef().elements();
  std::vector<c10::IValue> inputs(elements.begin(), elements.end());
  torch::NoGradGuard no_grad;
  const auto outputs = as_list(model.forward(inputs), name);
  write_file(dir / (name + ".outputs.pt"), torch::jit::pickle_save(outputs));
  std::cout << name << ": " << outputs.size() << " output(s)\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " DIR (runs DIR/*.model.pt on DIR/*.inputs.pt)\n";
    return 2;
  }
  std::cout << "attnkit " << attnkit::version() << "\n";
  std::vector<fs::path> models;
  for (const auto& entry : fs::directory_iterator(argv[1])) {
    const std::string file = entry.path().filename().string();
    if (file.size() > 9 && file.compare(file.size() - 9, 9, ".model.pt") == 0) models.push_back(entry.path());
  }
  std::sort(models.begin(), models.end());
  if (models.empty()) {
    std::cerr << argv[0] << ": no *.model.pt in " << argv[1] << "\n";
    return 1;
  }
  int failed = 0;
  for (const auto& path : models) {
    try {
      run(path);
    } catch (const std::exception& e) {
      std::cerr << path.filename().string() << ": " << e.what() << "\n";
      ++failed;
    }
  }
  return failed == 0 ? 0 : 1;
}
