#include "worker/models/torch_pickle.hpp"

#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <memory>
#include <vector>

#include "core/error.hpp"
#include "core/untrusted_file.hpp"

namespace dnallm::models {
namespace {

using torch::Tensor;

// See Note [State-dict unpickler].
struct Value;
using ValuePtr = std::shared_ptr<Value>;
struct Value {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kStr,
    kTuple,
    kList,
    kDict,
    kGlobal,
    kStorage,
    kTensor
  };
  Kind kind = Kind::kNone;
  int64_t i = 0;
  double f = 0;
  std::string s;                                  // string, global "module.name"
  std::vector<ValuePtr> items;                    // tuple, list
  std::vector<std::pair<ValuePtr, ValuePtr>> kv;  // dict
  Tensor tensor;                                  // storage (flat) or tensor
};

ValuePtr make(Value::Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}

constexpr size_t kMaxStack = size_t{1} << 20;
constexpr size_t kMaxMemo = size_t{1} << 24;

torch::ScalarType storage_dtype(const std::string& name) {
  static const std::map<std::string, torch::ScalarType> types = {
      {"torch.FloatStorage", torch::kFloat32},     {"torch.HalfStorage", torch::kFloat16},
      {"torch.BFloat16Storage", torch::kBFloat16}, {"torch.DoubleStorage", torch::kFloat64},
      {"torch.LongStorage", torch::kInt64},        {"torch.IntStorage", torch::kInt32},
      {"torch.ShortStorage", torch::kInt16},       {"torch.CharStorage", torch::kInt8},
      {"torch.ByteStorage", torch::kUInt8},        {"torch.BoolStorage", torch::kBool}};
  auto it = types.find(name);
  return it == types.end() ? torch::ScalarType::Undefined : it->second;
}

class Unpickler {
 public:
  Unpickler(const std::string& path, caffe2::serialize::PyTorchStreamReader& zip)
      : path_(path), zip_(zip) {
    std::tie(pickle_, size_) = zip_.getRecord("data.pkl");
    data_ = static_cast<const uint8_t*>(pickle_.get());
  }

  // Runs the pickle to its STOP and returns the value on top of the stack. Each opcode group
  // below handles its own opcodes and returns false for any other.
  ValuePtr run() {
    while (true) {
      const uint8_t op = byte();
      if (op == '.') {  // STOP
        check(!stack_.empty(), "STOP on an empty stack");
        return stack_.back();
      }
      if (!(stream_op(op) || container_op(op) || scalar_op(op) || object_op(op))) {
        fail(ExitCode::kCheckpointCorrupt,
             "{}: pickle opcode 0x{:02x} at byte {} is not one torch.save writes for a state "
             "dict: convert the file to model.safetensors",
             path_, op, pos_ - 1);
      }
    }
  }

  // Protocol, framing, the memo and marks.
  bool stream_op(uint8_t op) {
    switch (op) {
      case 0x80:  // PROTO
        byte();
        break;
      case 0x95:  // FRAME
        bytes(8);
        break;
      case 'q':  // BINPUT
        put(byte());
        break;
      case 'r':  // LONG_BINPUT
        put(uint32());
        break;
      case 0x94:  // MEMOIZE
        put(memo_.size());
        break;
      case 'h':  // BINGET
        get(byte());
        break;
      case 'j':  // LONG_BINGET
        get(uint32());
        break;
      case '(':  // MARK
        check(marks_.size() < kMaxStack, "too many marks");
        marks_.push_back(stack_.size());
        break;
      default:
        return false;
    }
    return true;
  }

  // Tuples, lists and dictionaries.
  bool container_op(uint8_t op) {
    switch (op) {
      case ')':  // EMPTY_TUPLE
        push(make(Value::Kind::kTuple));
        break;
      case 't': {  // TUPLE
        auto t = make(Value::Kind::kTuple);
        t->items = pop_to_mark();
        push(t);
        break;
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        const size_t n = op - 0x84;
        check(stack_.size() >= n, "TUPLE past the stack");
        auto t = make(Value::Kind::kTuple);
        t->items.assign(stack_.end() - long(n), stack_.end());
        stack_.resize(stack_.size() - n);
        push(t);
        break;
      }
      case ']':  // EMPTY_LIST
        push(make(Value::Kind::kList));
        break;
      case 'a': {  // APPEND
        auto v = pop();
        top(Value::Kind::kList)->items.push_back(v);
        break;
      }
      case 'e': {  // APPENDS
        auto items = pop_to_mark();
        auto list = top(Value::Kind::kList);
        list->items.insert(list->items.end(), items.begin(), items.end());
        break;
      }
      case '}':  // EMPTY_DICT
        push(make(Value::Kind::kDict));
        break;
      case 's': {  // SETITEM
        auto v = pop();
        auto k = pop();
        top(Value::Kind::kDict)->kv.emplace_back(k, v);
        break;
      }
      case 'u': {  // SETITEMS
        auto items = pop_to_mark();
        check(items.size() % 2 == 0, "SETITEMS with an odd number of items");
        auto dict = top(Value::Kind::kDict);
        for (size_t i = 0; i < items.size(); i += 2) dict->kv.emplace_back(items[i], items[i + 1]);
        break;
      }
      default:
        return false;
    }
    return true;
  }

  // Strings, integers, floats, None and booleans.
  bool scalar_op(uint8_t op) {
    switch (op) {
      case 'X': {  // BINUNICODE
        const uint32_t n = uint32();
        push_string(bytes(n), n);
        break;
      }
      case 0x8c:   // SHORT_BINUNICODE
      case 'U': {  // SHORT_BINSTRING
        const uint8_t n = byte();
        push_string(bytes(n), n);
        break;
      }
      case 'T': {  // BINSTRING
        const uint32_t n = uint32();
        push_string(bytes(n), n);
        break;
      }
      case 'J': {  // BININT
        int32_t v;
        std::memcpy(&v, bytes(4), 4);
        push_int(v);
        break;
      }
      case 'K':  // BININT1
        push_int(byte());
        break;
      case 'M': {  // BININT2
        uint16_t v;
        std::memcpy(&v, bytes(2), 2);
        push_int(v);
        break;
      }
      case 0x8a: {  // LONG1
        const uint8_t n = byte();
        check(n <= 8, "an integer of more than 64 bits");
        const uint8_t* p = bytes(n);
        uint64_t u = 0;
        for (int b = n - 1; b >= 0; --b) u = (u << 8) | p[b];
        if (n > 0 && n < 8 && (p[n - 1] & 0x80)) u |= ~uint64_t{0} << (8 * n);  // sign
        push_int(static_cast<int64_t>(u));
        break;
      }
      case 'G': {  // BINFLOAT (big-endian)
        const uint8_t* p = bytes(8);
        uint64_t u = 0;
        for (int b = 0; b < 8; ++b) u = (u << 8) | p[b];
        auto v = make(Value::Kind::kFloat);
        std::memcpy(&v->f, &u, 8);
        push(v);
        break;
      }
      case 'N':
        push(make(Value::Kind::kNone));
        break;
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        auto v = make(Value::Kind::kBool);
        v->i = op == 0x88 ? 1 : 0;
        push(v);
        break;
      }
      default:
        return false;
    }
    return true;
  }

  // Globals (allowed ones only), storages, calls and BUILD.
  bool object_op(uint8_t op) {
    switch (op) {
      case 'c': {  // GLOBAL
        auto module = line();
        auto name = line();
        push_global(module + "." + name);
        break;
      }
      case 'Q':  // BINPERSID
        push(storage(pop()));
        break;
      case 'R': {  // REDUCE
        auto args = pop();
        auto callable = pop();
        push(reduce(callable, args));
        break;
      }
      case 'b': {  // BUILD: an OrderedDict's _metadata, a tensor's state: not needed
        pop();
        check(!stack_.empty() && (stack_.back()->kind == Value::Kind::kDict ||
                                  stack_.back()->kind == Value::Kind::kTensor),
              "BUILD of something that is neither a dictionary nor a tensor");
        break;
      }
      default:
        return false;
    }
    return true;
  }

 private:
  void check(bool ok, const char* what) {
    DNALLM_CHECK(ok, ExitCode::kCheckpointCorrupt, "{}: damaged pickle ({} at byte {})", path_,
                 what, pos_);
  }
  uint8_t byte() { return *bytes(1); }
  const uint8_t* bytes(size_t n) {
    check(n <= size_ - pos_, "truncated");
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  uint32_t uint32() {
    uint32_t v;
    std::memcpy(&v, bytes(4), 4);
    return v;
  }
  std::string line() {
    std::string s;
    while (true) {
      const char c = static_cast<char>(byte());
      if (c == '\n') return s;
      check(s.size() < 256, "a global name longer than 256 bytes");
      s.push_back(c);
    }
  }
  void push(ValuePtr v) {
    check(stack_.size() < kMaxStack, "stack overflow");
    stack_.push_back(std::move(v));
  }
  ValuePtr pop() {
    check(!stack_.empty(), "pop from an empty stack");
    auto v = stack_.back();
    stack_.pop_back();
    return v;
  }
  ValuePtr top(Value::Kind kind) {
    check(!stack_.empty() && stack_.back()->kind == kind, "a container of the wrong kind");
    return stack_.back();
  }
  std::vector<ValuePtr> pop_to_mark() {
    check(!marks_.empty() && marks_.back() <= stack_.size(), "no mark");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items(stack_.begin() + long(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  void put(size_t index) {
    check(!stack_.empty() && index < kMaxMemo, "a memo index out of range");
    memo_[index] = stack_.back();
  }
  void get(size_t index) {
    auto it = memo_.find(index);
    check(it != memo_.end(), "a memo entry never stored");
    push(it->second);
  }
  void push_string(const uint8_t* p, size_t n) {
    auto v = make(Value::Kind::kStr);
    v->s.assign(reinterpret_cast<const char*>(p), n);
    push(v);
  }
  void push_int(int64_t i) {
    auto v = make(Value::Kind::kInt);
    v->i = i;
    push(v);
  }
  void push_global(const std::string& name) {
    const bool allowed = name == "collections.OrderedDict" ||
                         name == "torch._utils._rebuild_tensor_v2" ||
                         name == "torch._utils._rebuild_parameter" ||
                         storage_dtype(name) != torch::ScalarType::Undefined;
    DNALLM_CHECK(allowed, ExitCode::kCheckpointCorrupt,
                 "{}: the pickle names {}, which a state dict of tensors does not need (refused: "
                 "no Python object is built here); convert the file to model.safetensors",
                 path_, clip_for_message(name));
    auto v = make(Value::Kind::kGlobal);
    v->s = name;
    push(v);
  }

  // ('storage', torch.<Type>Storage, key, location, numel) -> the storage as a flat tensor.
  ValuePtr storage(const ValuePtr& pid) {
    check(pid->kind == Value::Kind::kTuple && pid->items.size() == 5 &&
              pid->items[0]->kind == Value::Kind::kStr && pid->items[0]->s == "storage" &&
              pid->items[1]->kind == Value::Kind::kGlobal &&
              pid->items[2]->kind == Value::Kind::kStr && pid->items[4]->kind == Value::Kind::kInt,
          "a persistent id that is not a storage");
    const std::string& key = pid->items[2]->s;
    auto cached = storages_.find(key);
    if (cached != storages_.end()) return cached->second;
    const auto dtype = storage_dtype(pid->items[1]->s);
    const int64_t numel = pid->items[4]->i;
    check(numel >= 0, "a negative storage size");
    const std::string record = "data/" + key;
    DNALLM_CHECK(zip_.hasRecord(record), ExitCode::kCheckpointCorrupt,
                 "{}: storage {} is not in the archive", path_, clip_for_message(key));
    auto [ptr, size] = zip_.getRecord(record);
    const size_t elem = c10::elementSize(dtype);
    DNALLM_CHECK(numel <= int64_t(size / std::max<size_t>(elem, 1)) && size == size_t(numel) * elem,
                 ExitCode::kCheckpointCorrupt,
                 "{}: storage {} holds {} bytes, not {} elements of {} bytes", path_,
                 clip_for_message(key), size, numel, elem);
    auto t = torch::empty({numel}, torch::TensorOptions().dtype(dtype));
    if (size > 0) std::memcpy(t.data_ptr(), ptr.get(), size);
    auto v = make(Value::Kind::kStorage);
    v->tensor = t;
    storages_.emplace(key, v);
    return v;
  }

  std::vector<int64_t> ints(const ValuePtr& tuple, const char* what) {
    check(tuple->kind == Value::Kind::kTuple, what);
    std::vector<int64_t> out;
    for (const auto& item : tuple->items) {
      check(item->kind == Value::Kind::kInt && item->i >= 0, what);
      out.push_back(item->i);
    }
    return out;
  }

  ValuePtr reduce(const ValuePtr& callable, const ValuePtr& args) {
    check(callable->kind == Value::Kind::kGlobal && args->kind == Value::Kind::kTuple,
          "REDUCE of something that is not a global");
    const std::string& f = callable->s;
    if (f == "collections.OrderedDict") {
      check(args->items.empty(), "OrderedDict with arguments");
      return make(Value::Kind::kDict);
    }
    if (f == "torch._utils._rebuild_parameter") {
      check(!args->items.empty() && args->items[0]->kind == Value::Kind::kTensor,
            "a parameter without its tensor");
      return args->items[0];
    }
    if (f == "torch._utils._rebuild_tensor_v2") {
      check(args->items.size() >= 4 && args->items[0]->kind == Value::Kind::kStorage &&
                args->items[1]->kind == Value::Kind::kInt && args->items[1]->i >= 0,
            "a tensor without storage and offset");
      const auto& flat = args->items[0]->tensor;
      const int64_t offset = args->items[1]->i;
      const auto size = ints(args->items[2], "a tensor size that is not non-negative integers");
      const auto stride = ints(args->items[3], "a tensor stride that is not non-negative integers");
      check(size.size() == stride.size() && size.size() <= 64, "size and stride disagree");
      // The last element reached must lie inside the storage (no overflow: sizes are bounded
      // by the storage's bytes, which the archive holds).
      int64_t last = offset;
      bool empty = false;
      for (size_t d = 0; d < size.size(); ++d) {
        if (size[d] == 0) empty = true;
        check(size[d] <= flat.numel() + 1 && stride[d] <= flat.numel() + 1,
              "a tensor larger than its storage");
        last += (size[d] - 1) * stride[d];
      }
      check(empty || (offset <= flat.numel() && last < flat.numel()),
            "a tensor outside its storage");
      auto v = make(Value::Kind::kTensor);
      v->tensor =
          empty ? torch::empty(size, flat.options()) : flat.as_strided(size, stride, offset);
      return v;
    }
    fail(ExitCode::kCheckpointCorrupt, "{}: cannot call {}", path_, clip_for_message(f));
  }

  const std::string& path_;
  caffe2::serialize::PyTorchStreamReader& zip_;
  at::DataPtr pickle_;
  size_t size_ = 0, pos_ = 0;
  const uint8_t* data_ = nullptr;
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;
  std::map<size_t, ValuePtr> memo_;
  std::map<std::string, ValuePtr> storages_;
};

}  // namespace

std::map<std::string, Tensor> load_torch_state_dict(const std::string& path) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
    DNALLM_CHECK(zip->hasRecord("data.pkl"), ExitCode::kCheckpointCorrupt,
                 "{}: a zip archive without data.pkl: not a torch.save file", path);
    if (zip->hasRecord("byteorder")) {
      auto [ptr, size] = zip->getRecord("byteorder");
      const std::string order(static_cast<const char*>(ptr.get()), size);
      DNALLM_CHECK(order == "little", ExitCode::kCheckpointCorrupt,
                   "{}: saved {}-endian; this reader is little-endian only", path,
                   clip_for_message(order));
    }
  } catch (const c10::Error& e) {
    fail(ExitCode::kCheckpointCorrupt,
         "{}: not a torch.save zip archive ({}): re-download it or convert it to "
         "model.safetensors",
         path, clip_for_message(e.what_without_backtrace(), 200));
  }
  ValuePtr root;
  try {
    Unpickler unpickler(path, *zip);
    root = unpickler.run();
  } catch (const c10::Error& e) {
    fail(ExitCode::kCheckpointCorrupt, "{}: damaged archive ({})", path,
         clip_for_message(e.what_without_backtrace(), 200));
  }
  DNALLM_CHECK(root->kind == Value::Kind::kDict, ExitCode::kCheckpointCorrupt,
               "{}: holds something other than a state dict (a dictionary of named tensors)", path);
  std::map<std::string, Tensor> out;
  for (const auto& [k, v] : root->kv) {
    DNALLM_CHECK(k->kind == Value::Kind::kStr && v->kind == Value::Kind::kTensor,
                 ExitCode::kCheckpointCorrupt,
                 "{}: an entry of the state dict is not a named tensor", path);
    DNALLM_CHECK(out.emplace(k->s, v->tensor.contiguous()).second, ExitCode::kCheckpointCorrupt,
                 "{}: tensor {} appears twice", path, clip_for_message(k->s));
  }
  return out;
}

}  // namespace dnallm::models
