#!/usr/bin/env bash
# Builds a CUDA-aware Open MPI on a Debian 12 machine with the CUDA toolkit (no
# GPU needed), packed to carry to a GPU machine that has no MPI of its own:
#   bash scripts/build_cuda_mpi.sh [OUTPUT_TGZ]   (default build/cuda-mpi.tar.gz)
# The archive holds one folder, cuda-mpi/: unpack it anywhere and point
# OPAL_PREFIX at it (with its bin/ on PATH and lib/ on LD_LIBRARY_PATH);
# scripts/gpu_check.sh does that with MPIJAX_MPI_TGZ=OUTPUT_TGZ. What was built,
# and how, is in cuda-mpi/BUILD-INFO.txt.
# The source is Debian's openmpi 4.1.4-3 source package, fetched with apt-get
# source through an apt state of its own under the work folder, so the
# machine's apt configuration is left as it is. CUDA support in Open MPI 4.1
# (the smcuda BTL, the cuda collectives, the CUDA-aware datatype engine) opens
# libcuda when a program starts, so it builds without a GPU or a driver; its
# MPIX_Query_cuda_support() says how it was built (1), not whether that worked.
# Idempotent: a second run reuses the download, the configured tree and the
# compiled objects, and only installs and packs again. Everything the tools
# print goes to build/cuda-mpi-build/build.log. Environment: CUDA_HOME (default
# /usr/local/cuda), MPIJAX_DEBIAN_MIRROR (default http://deb.debian.org/debian),
# JOBS (default: the number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
output=$(realpath -m "${1:-build/cuda-mpi.tar.gz}")
cuda=${CUDA_HOME:-/usr/local/cuda}
mirror=${MPIJAX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
version=4.1.4-3  # bookworm's; pinned so that a later run builds the same source
work=$PWD/build/cuda-mpi-build
log=$work/build.log
# Not where it will live: the archive is unpacked elsewhere and found through
# OPAL_PREFIX, so a prefix that exists nowhere shows at once if it is not.
prefix=/opt/mpijax-cuda-mpi
mkdir -p "$work"
: >"$log"
step() { echo "== $*" | tee -a "$log"; }
fail() { echo "failed: the end of $log:"; tail -n 40 "$log"; exit 1; }
trap fail ERR

[ -f "$cuda/include/cuda.h" ] || { echo "no $cuda/include/cuda.h: set CUDA_HOME to the CUDA toolkit"; exit 1; }
for tool in apt-get dpkg-source make gcc g++ perl; do
  command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install dpkg-dev build-essential)"; exit 1; }
done

src=$work/openmpi-$version
if [ ! -f "$src/configure" ]; then
  step "fetching Debian's openmpi $version source package"
  # deb-src lines in a sources list of our own, with lists and cache of our
  # own. apt checks the files against the signed index, with Debian's keyring.
  apt=$work/apt
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$work/dl"
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  cat >"$apt/sources.list" <<EOF
deb-src [signed-by=$keyring] $mirror bookworm main
deb-src [signed-by=$keyring] $mirror bookworm-updates main
EOF
  aptopts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/nonexistent
           -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root)
  apt-get "${aptopts[@]}" update >>"$log" 2>&1
  (cd "$work/dl" && apt-get "${aptopts[@]}" source --download-only "openmpi=$version") >>"$log" 2>&1
  # Upstream's source as Debian ships it, without Debian's patches: they touch
  # configure.ac and Makefile.am (Debian runs autoreconf; this script does not
  # need to), and none matters on x86-64 (other architectures, packaging).
  rm -rf "$src"
  dpkg-source --skip-patches -x "$work/dl/openmpi_$version.dsc" "$src" >>"$log" 2>&1
fi

# Self-contained (hwloc, libevent and PMIx from Open MPI's own tree, none of
# the network or scheduler libraries of this machine) so it runs on another
# distribution: what it links is glibc and zlib (reachable-netlink, left out,
# would need libnl). Only the parts mpijax, mpi4py and mpirun on one node need,
# to keep the compile short on few cores: no Fortran, Java, OpenSHMEM, ROMIO.
config=(
  --prefix="$prefix"
  --with-cuda="$cuda"
  --enable-mpi-ext=cuda
  --with-hwloc=internal --with-libevent=internal --with-pmix=internal
  --disable-mpi-fortran --disable-mpi-java --disable-oshmem --disable-io-romio
  --without-ucx --without-verbs --without-ofi --without-psm --without-psm2 --without-portals4
  --without-knem --without-xpmem --without-hcoll --without-fca --without-ucc
  --without-lustre --without-gpfs --without-pvfs2
  --without-tm --without-lsf --without-alps --without-sge --without-slurm
  --enable-mca-no-build="btl-openib,btl-usnic,btl-uct,pml-ucx,osc-ucx,mtl,coll-hcoll,coll-fca,coll-ucc,topo-treematch,vprotocol,reachable-netlink"
  --disable-static --disable-dependency-tracking --enable-silent-rules
  --with-package-string="mpijax CUDA-aware Open MPI (Debian openmpi $version)"
)
bld=$work/obj
if [ ! -f "$bld/Makefile" ] || [ "$(cat "$bld/configure-line" 2>/dev/null)" != "${config[*]}" ]; then
  step "configuring (with CUDA from $cuda)"
  rm -rf "$bld"
  mkdir -p "$bld"
  (cd "$bld" && "$src/configure" "${config[@]}") >>"$log" 2>&1
  echo "${config[*]}" >"$bld/configure-line"
fi
grep -q '^#define OPAL_CUDA_SUPPORT 1' "$bld/opal/include/opal_config.h" \
  || { echo "configure left CUDA support out: see $log"; exit 1; }

jobs=${JOBS:-$(nproc)}
step "compiling with $jobs jobs (5 to 15 minutes on 2 cores)"
make -C "$bld" -j"$jobs" >>"$log" 2>&1

step "installing, stripping and packing into $output"
stage=$work/stage
rm -rf "$stage"
make -C "$bld" install DESTDIR="$stage" >>"$log" 2>&1
root=$stage$prefix
# Only what running and compiling against it need: no libtool archives, no
# manual pages (the help texts in share/openmpi stay: mpirun prints them).
find "$root" -name '*.la' -delete
rm -rf "$root/share/man" "$root/share/doc"
find "$root/bin" "$root/lib" -type f \( -perm -u+x -o -name '*.so*' \) -exec sh -c \
  'for f; do file -b "$f" | grep -q ELF && strip --strip-unneeded "$f"; done' sh {} +
# Ask the installed tree itself, relocated as it will be on the GPU machine.
oi() { OPAL_PREFIX=$root LD_LIBRARY_PATH=$root/lib "$root/bin/ompi_info" "$@"; }
built=$(oi --parsable --all | sed -n 's/^mca:mpi:base:param:mpi_built_with_cuda_support:value://p')
[ "$built" = true ] || { echo "ompi_info says mpi_built_with_cuda_support is '$built', not true"; exit 1; }
cat >"$root/BUILD-INFO.txt" <<EOF
CUDA-aware Open MPI for mpijax, built by scripts/build_cuda_mpi.sh
date:     $(date -u +%Y-%m-%dT%H:%M:%SZ)
source:   Debian openmpi $version source package ($mirror), upstream Open MPI $(sed -n 's/^\(major\|minor\|release\)=//p' "$src/VERSION" | paste -sd.), without Debian's patches
machine:  $(sed -n 's/^PRETTY_NAME="\(.*\)"$/\1/p' /etc/os-release), $(uname -m)
compiler: $(gcc --version | head -n 1)
CUDA:     $("$cuda/bin/nvcc" --version 2>/dev/null | grep release || echo "$cuda")
prefix:   $prefix (relocate: OPAL_PREFIX=<unpacked cuda-mpi>, with its bin/ on PATH and lib/ on LD_LIBRARY_PATH)
configure: ${config[*]}
ompi_info, from the installed tree:
  mpi_built_with_cuda_support: $built
  extensions: $(oi --parsable | sed -n 's/^options:mpi_ext://p')
$(for f in btl coll pml; do echo "  $f: $(oi --parsable | sed -n "s/^mca:$f:\([^:]*\):version:.*/\1/p" | sort -u | paste -sd' ')"; done)
EOF
mkdir -p "$(dirname "$output")"
tar -C "$stage$(dirname "$prefix")" --transform "s|^$(basename "$prefix")|cuda-mpi|" \
  --owner=0 --group=0 -czf "$output.tmp" "$(basename "$prefix")"
mv "$output.tmp" "$output"
step "done: $output ($(du -h "$output" | cut -f1)); $(grep -c . "$root/BUILD-INFO.txt") lines in cuda-mpi/BUILD-INFO.txt"
