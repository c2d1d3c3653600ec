#!/bin/sh
# Build a small kernel from Debian's linux-source package, as a buildroot user
# would: `make tinyconfig`, a config fragment merged over it, bzImage + vmlinux.
#
#   build-minimal-kernel.sh SOURCE_PACKAGE FRAGMENT WORKDIR OUTDIR
#
# SOURCE_PACKAGE is e.g. linux-source-6.12 (fetched with `apt-get download`,
# no root needed), FRAGMENT a file of CONFIG_ lines (kernels/minimal-6.12.config),
# WORKDIR a scratch directory (the source and objects, a few GB, removed on
# success), OUTDIR an empty directory that receives bzImage, vmlinux,
# System.map, config and build.json (package version and the build's wall
# time). qprobe runs this under its cache's build lock and renames OUTDIR into
# place only when it exits 0 (`qprobe images --fetch minimal-6.12`).
#
# JOBS (default: the number of CPUs) and NICE (default 10) tune `make`.
set -eu

[ $# -eq 4 ] || { echo "usage: $0 SOURCE_PACKAGE FRAGMENT WORKDIR OUTDIR" >&2; exit 2; }
pkg=$1
fragment=$(realpath "$2")
work=$3
out=$(realpath "$4")
jobs=${JOBS:-$(nproc)}
nice=${NICE:-10}

for tool in apt-get dpkg-deb make gcc flex bison bc perl xz; do
	command -v "$tool" >/dev/null || { echo "$0: $tool not found (apt-get install build-essential flex bison bc libelf-dev xz-utils)" >&2; exit 1; }
done
# objtool links against libelf; without its headers the build fails late.
[ -e /usr/include/libelf.h ] || { echo "$0: libelf.h not found (apt-get install libelf-dev)" >&2; exit 1; }

start=$(date +%s)
mkdir -p "$work"
cd "$work"
rm -f ./*.deb
apt-get download -q "$pkg"
deb=$(ls ./*.deb)
version=$(dpkg-deb -f "$deb" Version)
echo "$0: $pkg $version"
# The package holds one tarball, usr/src/<pkg>.tar.xz, whose top directory is <pkg>/.
dpkg-deb --fsys-tarfile "$deb" | tar -x --wildcards './usr/src/*.tar.xz'
rm -rf "$pkg"
tar -xf "usr/src/$pkg.tar.xz"
rm -rf usr "$deb"
cd "$pkg"

make -s ARCH=x86_64 tinyconfig
scripts/kconfig/merge_config.sh -m .config "$fragment" >/dev/null
make -s ARCH=x86_64 olddefconfig
# merge_config.sh only warns when a value does not stick (a dependency
# missing): a fragment line that did not make it into .config is an error.
bad=0
while IFS= read -r line; do
	case $line in
	CONFIG_*=*) grep -qx "$line" .config || { echo "$0: not in .config: $line" >&2; bad=1; } ;;
	"# CONFIG_"*" is not set")
		opt=${line#\# }; opt=${opt%% *}
		! grep -q "^$opt=" .config || { echo "$0: still set: $opt" >&2; bad=1; } ;;
	esac
done <"$fragment"
[ $bad -eq 0 ]

nice -n "$nice" make -s ARCH=x86_64 -j"$jobs" bzImage
end=$(date +%s)

cp arch/x86/boot/bzImage "$out/bzImage"
cp vmlinux "$out/vmlinux"
cp System.map "$out/System.map"
cp .config "$out/config"
release=$(cat include/config/kernel.release)
printf '{"package": "%s", "version": "%s", "release": "%s", "jobs": %s, "build_seconds": %s}\n' \
	"$pkg" "$version" "$release" "$jobs" "$((end - start))" >"$out/build.json"
cd /
rm -rf "$work"
echo "$0: built $release in $((end - start)) s"
