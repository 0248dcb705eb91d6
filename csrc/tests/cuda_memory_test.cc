// The CUDA memory policy's logic, against the stand-in runtime of
// fake_cudart.h: what is copied which way, when the arena is reused, what MPI
// is shown after a CUDA error, which calls Run stages in CUDA-aware mode.
// Whether real copies order correctly on XLA's stream is for
// tests/test_gpu.py on a GPU.
#include "cuda_memory.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "fake_cudart.h"
#include "memory.h"
#include "registry.h"
#include "run.h"

namespace mpijax {
namespace {

cudaStream_t Stream() {
  static int stream;
  return reinterpret_cast<cudaStream_t>(&stream);
}

// A float32 "device" buffer of n elements, 0, 1, 2, ... + first.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(int64_t n, float first = 0) : dims_{n}, data_(n) {
    std::iota(data_.begin(), data_.end(), first);
    raw_ = {
        XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_F32, data_.data(), 1, dims_.data()};
  }
  xla::ffi::AnyBuffer buffer() { return xla::ffi::AnyBuffer(&raw_); }
  std::vector<float>& data() { return data_; }

 private:
  std::vector<int64_t> dims_;
  std::vector<float> data_;
  XLA_FFI_Buffer raw_;
};

const float* Floats(const void* view) { return static_cast<const float*>(view); }

class CudaMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetCudaAware(false);
    fake_cudart::Reset();
  }
  void TearDown() override { SetCudaAware(false); }
};

// f(m.In(x), m.Out(y)) evaluates its arguments in either order: an in-place
// call must see its input whichever view it takes first.
TEST_F(CudaMemoryTest, InPlaceViewsInEitherOrder) {
  for (bool out_first : {false, true}) {
    DeviceBuffer x(5, 10);
    auto buffer = x.buffer();
    CudaMemory m(Stream(), false);
    void* out = out_first ? m.Out(buffer) : nullptr;
    void* in = m.In(buffer);
    if (!out_first) out = m.Out(buffer);
    ASSERT_EQ(in, out);
    ASSERT_NE(in, x.data().data()) << "staged: MPI must see host memory";
    EXPECT_EQ(std::vector<float>(Floats(in), Floats(in) + 5),
              (std::vector<float>{10, 11, 12, 13, 14}))
        << "out_first=" << out_first;
    static_cast<float*>(out)[0] = -1;
    m.Finish();
    EXPECT_EQ(m.error(), "");
    EXPECT_EQ(x.data()[0], -1) << "the output goes back to the device";
  }
}

TEST_F(CudaMemoryTest, InputsCopiedInOnceOutputsCopiedBack) {
  DeviceBuffer x(4), y(8, 100);
  auto xb = x.buffer(), yb = y.buffer();
  CudaMemory m(Stream(), false);
  const void* in = m.In(xb);
  EXPECT_EQ(m.In(xb), in) << "the same buffer gives the same view";
  auto* out = static_cast<float*>(m.Out(yb));
  EXPECT_EQ(fake_cudart::counts().to_host, 1) << "an output is not copied in";
  for (int i = 0; i < 8; ++i) out[i] = Floats(in)[i % 4] * 2;
  m.Finish();
  EXPECT_EQ(fake_cudart::counts().to_device, 1) << "only the output goes back";
  EXPECT_EQ(y.data(), (std::vector<float>{0, 2, 4, 6, 0, 2, 4, 6}));
  EXPECT_EQ(x.data(), (std::vector<float>{0, 1, 2, 3}));
}

// A collective that timed out leaves its pinned memory to MPI, which may
// still complete into it: later calls get other memory, where without
// Abandon they reuse the same.
TEST_F(CudaMemoryTest, AnAbandonedCallsPinnedMemoryIsNeverHandedOutAgain) {
  DeviceBuffer x(4);
  auto xb = x.buffer();
  const auto view = [&](bool abandon) {
    CudaMemory m(Stream(), false, /*abandonable=*/true);
    void* out = m.Out(xb);
    if (abandon) m.Abandon();
    return out;
  };
  void* first = view(false);
  EXPECT_EQ(view(false), first) << "the arena is reused";
  EXPECT_EQ(view(true), first);
  EXPECT_NE(view(false), first) << "abandoned memory was handed out again";
}

// XLA may place an empty buffer at another's address: each is a view of its
// own, and the full one is staged (it was taken for the empty one, whose
// view is the device address itself, and MPI was shown device memory).
TEST_F(CudaMemoryTest, AnEmptyBufferAtAnothersAddressIsAViewOfItsOwn) {
  DeviceBuffer x(4);
  int64_t none = 0;
  XLA_FFI_Buffer raw = {
      XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_F32, x.data().data(), 1, &none};
  auto empty = xla::ffi::AnyBuffer(&raw), xb = x.buffer();
  CudaMemory m(Stream(), false);
  m.Out(empty);
  const void* in = m.In(xb);
  ASSERT_NE(in, x.data().data()) << "staged: MPI must see host memory";
  EXPECT_EQ(std::vector<float>(Floats(in), Floats(in) + 4), (std::vector<float>{0, 1, 2, 3}));
}

// The copies queued on XLA's stream follow its kernels: a staged call waits
// for the stream only for an input's copy, before MPI reads it.
TEST_F(CudaMemoryTest, StagedCallsWaitForTheStreamOncePerInput) {
  DeviceBuffer x(4), y(4), z(4);
  auto xb = x.buffer(), yb = y.buffer(), zb = z.buffer();
  const auto syncs = [](auto call) {
    fake_cudart::Reset();
    CudaMemory m(Stream(), false);
    call(m);
    m.Finish();
    EXPECT_EQ(m.error(), "");
    return fake_cudart::counts().stream_syncs;
  };
  EXPECT_EQ(syncs([&](CudaMemory& m) { m.Out(zb); }), 0) << "a receive";
  EXPECT_EQ(syncs([&](CudaMemory& m) { m.Out(zb), m.In(xb); }), 1) << "a sendrecv";
  EXPECT_EQ(syncs([&](CudaMemory& m) { m.In(xb), m.In(yb), m.Out(zb); }), 2);
  EXPECT_EQ(syncs([&](CudaMemory& m) { m.In(xb), m.Out(xb); }), 1) << "in place";
}

TEST_F(CudaMemoryTest, ArenaReusedAcrossCallsAndGrownOnDemand) {
  DeviceBuffer small(1000), big(100000);
  auto sb = small.buffer(), bb = big.buffer();
  // One call reading `in` and writing `out`; the pinned memory MPI saw.
  const auto call = [](xla::ffi::AnyBuffer& in, xla::ffi::AnyBuffer& out) {
    CudaMemory m(Stream(), false);
    void* seen = m.In(in);
    m.Out(out);
    m.Finish();
    return seen;
  };
  call(sb, sb);  // whatever earlier tests left, the arena now fits this call
  call(sb, sb);
  fake_cudart::Reset();
  void* first = call(sb, sb);
  EXPECT_EQ(call(sb, sb), first) << "the next call reuses the pinned memory";
  EXPECT_EQ(fake_cudart::counts().pinned_allocs, 0);
  EXPECT_EQ(fake_cudart::counts().event_waits, 2) << "each after the previous call's copies back";

  call(sb, bb);  // outgrows the arena: a further block
  EXPECT_EQ(fake_cudart::counts().pinned_allocs, 1);
  fake_cudart::Reset();
  for (int i = 0; i < 3; ++i) call(sb, bb);
  // The next call makes the blocks one, which then fits every call.
  EXPECT_EQ(fake_cudart::counts().pinned_allocs, 1);
  EXPECT_EQ(fake_cudart::counts().pinned_frees, 2);
}

TEST_F(CudaMemoryTest, CudaAwareShowsDeviceMemoryUnlessTheCallNeedsTheHost) {
  SetCudaAware(true);
  DeviceBuffer x(3);
  auto xb = x.buffer();
  ResetStats();
  {
    CudaMemory m(Stream(), false);
    EXPECT_EQ(m.In(xb), x.data().data());
    m.Finish();
  }
  EXPECT_EQ(fake_cudart::counts().to_host + fake_cudart::counts().to_device, 0);
  EXPECT_EQ(fake_cudart::counts().stream_syncs, 1) << "XLA's stream, before MPI reads";
  EXPECT_EQ(Stats().device_pointer_calls, 1);
  {
    CudaMemory m(Stream(), true);
    EXPECT_NE(m.In(xb), x.data().data()) << "host access: staged";
    m.Finish();
  }
  EXPECT_EQ(Stats().device_pointer_calls, 1) << "a staged call is not counted";
}

// Run (run.h) makes the policy: a CUDA-aware collective is staged while the
// watchdog is on, point-to-point calls still hand MPI device memory.
TEST_F(CudaMemoryTest, CudaAwareCollectivesAreStagedUnderTheWatchdog) {
  SetCudaAware(true);
  DeviceBuffer x(3);
  auto xb = x.buffer();
  const int64_t world = RegisterComm(MPI_COMM_WORLD);
  auto device_memory_shown = [&](CallInfo info) {
    bool device = false;
    const xla::ffi::Error error = mpijax::Run<CudaMemory>(Stream(), info, world, kNoHostAccess,
                                                          [&](const Comm&, CudaMemory& m) {
                                                            device = m.In(xb) == x.data().data();
                                                            return MPI_SUCCESS;
                                                          });
    EXPECT_TRUE(error.success()) << info.op;
    return device;
  };
  CallInfo allreduce, send, neighbors;
  allreduce.op = "allreduce";
  send.op = "send";
  send.dest = 0;
  neighbors.op = "neighbor_exchange";
  neighbors.checked = false;
  for (double timeout : {0.0, 60.0}) {
    mpi::SetTimeout(timeout);
    EXPECT_EQ(device_memory_shown(allreduce), timeout == 0) << "timeout " << timeout;
    EXPECT_TRUE(device_memory_shown(send)) << "timeout " << timeout;
    EXPECT_TRUE(device_memory_shown(neighbors)) << "timeout " << timeout;
  }
  mpi::SetTimeout(0);
}

TEST_F(CudaMemoryTest, AfterACudaErrorMpiSeesHostScratchAndNothingGoesBack) {
  DeviceBuffer x(6, 1);
  auto xb = x.buffer();
  fake_cudart::FailNextPinnedAlloc();
  {
    // A fresh, larger buffer than any before, so that the arena must grow.
    DeviceBuffer huge(1 << 22);
    auto hb = huge.buffer();
    CudaMemory m(Stream(), false);
    void* view = m.Out(hb);
    EXPECT_NE(view, huge.data().data());
    EXPECT_NE(m.error().find("allocating pinned host memory: out of memory"), std::string::npos)
        << m.error();
    EXPECT_NE(m.In(xb), x.data().data()) << "every later view is scratch too";
    static_cast<float*>(view)[0] = -1;
    m.Finish();
    EXPECT_EQ(huge.data()[0], 0) << "nothing is copied back after an error";
  }
  EXPECT_EQ(fake_cudart::counts().to_device, 0);
}

// Fill (memory.h) through each policy: an element of 4 bytes over 7 floats
// (doubling copies, the last one partial), and a zero element.
TEST_F(CudaMemoryTest, FillWritesTheElementOverTheWholeView) {
  const float value = 2.5f;
  const auto* bytes = reinterpret_cast<const uint8_t*>(&value);
  const std::vector<uint8_t> zero(4, 0);
  for (const auto& element : {std::vector<uint8_t>(bytes, bytes + 4), zero}) {
    const float want = element == zero ? 0.0f : value;
    const auto fill = [&](auto& m, xla::ffi::AnyBuffer& y) {
      Fill(m, m.Out(y), xla::ffi::Span<const uint8_t>(element), y.size_bytes());
      m.Finish();
      EXPECT_EQ(m.error(), "");
    };
    for (bool aware : {false, true}) {
      SetCudaAware(aware);
      DeviceBuffer y(7, 100);
      auto yb = y.buffer();
      CudaMemory m(Stream(), false);
      fill(m, yb);
      EXPECT_EQ(y.data(), std::vector<float>(7, want)) << "CUDA-aware: " << aware;
    }
    DeviceBuffer host(7, 100);
    auto hb = host.buffer();
    HostMemory h(HostMemory::Context{}, false);
    fill(h, hb);
    EXPECT_EQ(host.data(), std::vector<float>(7, want));
  }
}

TEST_F(CudaMemoryTest, EmptyBuffersMoveNothing) {
  DeviceBuffer empty(0);
  auto eb = empty.buffer();
  CudaMemory m(Stream(), false);
  m.In(eb);
  m.Out(eb);
  m.Finish();
  EXPECT_EQ(m.error(), "");
  EXPECT_EQ(fake_cudart::counts().to_host + fake_cudart::counts().to_device, 0);
}

}  // namespace
}  // namespace mpijax
