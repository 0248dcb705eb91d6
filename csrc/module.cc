// The Python extension mpijax._core: FFI handler capsules, the communicator
// registry, and what Python needs to know about the linked MPI library.
#include <dlfcn.h>
#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: MPIX_Query_cuda_support
#endif
#include <mpi4py/mpi4py.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <climits>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "check.h"
#ifdef MPIJAX_CUDA
#include "cuda_memory.h"
#endif
#include "handlers.h"
#include "log.h"
#include "mpi_calls.h"
#include "pending.h"
#include "reductions.h"
#include "registry.h"
#include "tags.h"

namespace nb = nanobind;

namespace mpijax {
namespace {

std::string RealPathOf(const void* symbol) {
  Dl_info info;
  if (!dladdr(symbol, &info) || !info.dli_fname) return "";
  char* resolved = realpath(info.dli_fname, nullptr);
  if (!resolved) return info.dli_fname;
  std::string path(resolved);
  std::free(resolved);
  return path;
}

// The file that provides MPI_Init to the already loaded shared object `module`
// (itself or one of its dependencies); "" if that cannot be determined.
std::string MpiLibraryOf(const std::string& module) {
  void* handle = dlopen(module.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (!handle) return "";
  void* symbol = dlsym(handle, "MPI_Init");
  dlclose(handle);
  return symbol ? RealPathOf(symbol) : "";
}

#define MPIJAX_STRING(x) MPIJAX_STRING_(x)
#define MPIJAX_STRING_(x) #x

// The MPI whose headers this file was compiled with.
const char* HeaderVersion() {
#if defined(OPEN_MPI)
  return "Open MPI " MPIJAX_STRING(OMPI_MAJOR_VERSION) "." MPIJAX_STRING(
      OMPI_MINOR_VERSION) "." MPIJAX_STRING(OMPI_RELEASE_VERSION) " headers";
#elif defined(MPICH_VERSION)
  return "MPICH " MPICH_VERSION " headers";
#else
  return "MPI " MPIJAX_STRING(MPI_VERSION) "." MPIJAX_STRING(MPI_SUBVERSION) " headers";
#endif
}

// Whether the MPI library moves device memory: 1 yes, 0 no, -1 it cannot
// tell (Open MPI's and MPICH's extensions answer; other libraries may not).
int CudaAwareMpi() {
#if defined(OPEN_MPI) && defined(MPIX_CUDA_AWARE_SUPPORT)
  return MPIX_Query_cuda_support();
#elif defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;
  return MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) == MPI_SUCCESS ? supported : -1;
#else
  return -1;
#endif
}

std::string LibraryVersion() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(version, &length);
  return std::string(version, length);
}

}  // namespace
}  // namespace mpijax

NB_MODULE(_core, m) {
  using namespace mpijax;
  // An mpi4py built on another MPI library fails here, since its objects have
  // another layout. Stay importable so that Python can name both libraries.
  std::string mpi4py_error;
  if (import_mpi4py() < 0) mpi4py_error = nb::python_error().what();
  m.attr("mpi4py_error") = mpi4py_error;
  m.attr("ROUTED") = kRouted;
  m.attr("STATUS_BYTES") = sizeof(MPI_Status);
  m.attr("ENVELOPE_BYTES") = sizeof(Envelope);
  const Envelope unrouted = NoRoute();
  m.attr("UNROUTED") = nb::bytes(reinterpret_cast<const char*>(&unrouted), sizeof unrouted);
  m.def("largest_tag", &LargestTag);
  m.def("derivative_tag", &DerivativeTag);

  m.def("ffi_targets", [] {
    nb::dict platforms;
    for (const auto& [platform, handlers] : HandlersByPlatform()) {
      nb::dict targets;
      for (const auto& [name, handler] : handlers) {
        targets[name] = nb::capsule(reinterpret_cast<void*>(handler));
      }
      platforms[platform.c_str()] = targets;
    }
    return platforms;
  });
  m.def("cuda_aware_mpi", &CudaAwareMpi);
#ifdef MPIJAX_CUDA
  m.def("set_cuda_aware", &SetCudaAware);
  m.def("cuda_aware", &CudaAware);
  m.def("cuda_device_count", &CudaDeviceCount);
#endif

  m.def(
      "register_comm",
      [mpi4py_error](nb::handle comm) {
        if (!mpi4py_error.empty()) throw std::runtime_error("mpi4py's C API: " + mpi4py_error);
        MPI_Comm* handle = PyMPIComm_Get(comm.ptr());
        if (!handle) throw nb::python_error();
        return RegisterComm(*handle);
      },
      "Id of an mpi4py communicator in the handlers' registry.");
  m.def("abandoned_by", &AbandonedBy,
        "The op of the collective that timed out on communicator `id` (which takes no more "
        "calls), or ''.");

  m.def(
      "register_op",
      [mpi4py_error](nb::handle op) {
        if (!mpi4py_error.empty()) throw std::runtime_error("mpi4py's C API: " + mpi4py_error);
        MPI_Op* handle = PyMPIOp_Get(op.ptr());
        if (!handle) throw nb::python_error();
        return kFirstUserOp + RegisterOp(*handle);
      },
      "Reduction code of a user-defined mpi4py MPI.Op (MPI.Op.Create).");

  m.def("reductions", [] {
    nb::dict codes;
    for (int i = 0; i < kNumReductions; ++i) codes[ReductionName(static_cast<Reduction>(i))] = i;
    return codes;
  });

  m.def("mpi_library", [] {
    return std::make_pair(RealPathOf(reinterpret_cast<void*>(&MPI_Init)), LibraryVersion());
  });
  m.attr("built_for") =
      std::make_pair(std::string(MPIJAX_MPI_LIBRARY), std::string(HeaderVersion()));
  m.def("mpi_library_of", &MpiLibraryOf);
  m.def("mpi_initialized", [] {
    int flag = 0;
    MPI_Initialized(&flag);
    return flag != 0;
  });

  m.def("set_logging", &SetLogEnabled);
  m.def("logging", &LogEnabled);
  m.def("set_check", &SetCheckEnabled);
  m.def("check", &CheckEnabled);
  m.def("set_timeout", &mpi::SetTimeout);
  m.def("timeout", &mpi::Timeout);
  m.def("stats", [] {
    const CallStats s = Stats();
    nb::dict d;
    d["calls"] = s.calls;
    d["in_flight"] = s.in_flight;
    d["max_in_flight"] = s.max_in_flight;
    d["device_pointer_calls"] = s.device_pointer_calls;
    return d;
  });
  m.def("reset_stats", &ResetStats);
  m.def("pending_requests", &PendingCount);
  m.def("set_count_limit", &mpi::SetCountLimit);
  m.def("count_limit", &mpi::CountLimit);
}
