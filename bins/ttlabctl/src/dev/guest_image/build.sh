#!/bin/sh
# Builds the ttlab Debian 12 (bookworm) guest image from Debian's packages: a debootstrap
# root with systemd, cloud-init (NoCloud only, no network config of its own), the cloud
# kernel and a serial console, written into an ext4 filesystem that fills the whole disk (no
# partition table, no boot loader: the kernel and initrd are kept beside the disk and given to
# qemu directly) and converted to qcow2.
#
# Run by `ttlabctl guest-image` as root:  build.sh WORKDIR MIRROR SUITE SIZE
# It leaves WORKDIR/disk.qcow2, WORKDIR/vmlinuz, WORKDIR/initrd.img and WORKDIR/versions
# (package versions, one `name version` a line). It reaches nothing but MIRROR.
set -eu
work=$1
mirror=$2
suite=$3
size=$4
root="$work/root"

say() { printf 'guest-image: %s\n' "$*" >&2; }

cleanup() {
  for m in proc sys dev/pts dev; do
    if mountpoint -q "$root/$m" 2>/dev/null; then umount -l "$root/$m" || true; fi
  done
}
trap cleanup EXIT INT TERM

packages=systemd,systemd-sysv,udev,dbus,cloud-init,linux-image-cloud-amd64,initramfs-tools,\
python3-cffi-backend,e2fsprogs,procps,iproute2,less,nano,vim-tiny,ca-certificates,netbase,kmod,bash-completion

rm -rf "$root"
mkdir -p "$root"
say "debootstrap $suite from $mirror (minbase + $packages)"
mkdir -p "$work/debs"
# (Virtual dependencies are not resolved by debootstrap: python3-cffi-backend is named
# for python3-cryptography.)
debootstrap --variant=minbase --cache-dir="$work/debs" --include="$packages" "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
  tail -n 40 "$work/debootstrap.log" >&2
  exit 1
}

say "configuring the guest"
echo ttlab-guest >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
printf 'LABEL=ttlab-root\t/\text4\terrors=remount-ro\t0\t1\n' >"$root/etc/fstab"
printf 'deb %s %s main\n' "$mirror" "$suite" >"$root/etc/apt/sources.list"

# Network: DHCP on every Ethernet link with systemd-networkd (qemu's user-mode network has a
# DHCP server); cloud-init leaves the network alone.
mkdir -p "$root/etc/systemd/network"
cat >"$root/etc/systemd/network/10-ttlab-dhcp.network" <<'NET'
[Match]
Name=en* eth*

[Network]
DHCP=ipv4
LinkLocalAddressing=no
IPv6AcceptRA=no
NET

# cloud-init: the NoCloud seed (a `cidata` volume) only, no network configuration.
cat >"$root/etc/cloud/cloud.cfg.d/90-ttlab.cfg" <<'CFG'
datasource_list: [NoCloud, None]
network: {config: disabled}
locale: C.UTF-8
CFG
# The system's locale is C.UTF-8, which glibc has built in: cloud-init's locale module finds it
# already set and runs nothing. (Its default, en_US.UTF-8, is not generated on a debootstrap
# root: update-locale refused it, cloud-config.service failed on every boot and systemd said
# "degraded".)
printf 'LANG=C.UTF-8\n' >"$root/etc/default/locale"

# Initrd with the virtio drivers; the kernel finds the root filesystem by label.
echo 'MODULES=most' >"$root/etc/initramfs-tools/conf.d/ttlab"
printf 'virtio_blk\nvirtio_pci\nvirtio_net\next4\n' >>"$root/etc/initramfs-tools/modules"

mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys"
mount --bind /dev "$root/dev"
mount --bind /dev/pts "$root/dev/pts"
chroot "$root" /bin/sh -eu <<'CHROOT'
export DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
systemctl enable systemd-networkd.service serial-getty@ttyS0.service >/dev/null
# Nothing in the lab VM fetches updates in the background.
systemctl mask apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer >/dev/null 2>&1 || true
# Boot to a shell without waiting for a network that is never awaited.
systemctl mask systemd-networkd-wait-online.service >/dev/null
update-initramfs -u -k all >/dev/null
passwd -l root >/dev/null
apt-get clean
rm -rf /var/lib/apt/lists/* /var/log/*.log /var/cache/debconf/*-old
: >/etc/machine-id
rm -f /var/lib/dbus/machine-id
CHROOT
dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${Package} ${Version}\n' \
  cloud-init systemd linux-image-cloud-amd64 libc6 base-files >"$work/versions"
kernel=$(readlink -f "$root/vmlinuz")
initrd=$(readlink -f "$root/initrd.img")
cp "$kernel" "$work/vmlinuz"
cp "$initrd" "$work/initrd.img"
cleanup
trap - EXIT INT TERM

say "writing the $size ext4 filesystem and converting it to qcow2"
rm -f "$work/disk.raw" "$work/disk.qcow2"
truncate -s "$size" "$work/disk.raw"
mkfs.ext4 -q -L ttlab-root -d "$root" "$work/disk.raw"
qemu-img convert -f raw -O qcow2 "$work/disk.raw" "$work/disk.qcow2"
rm -f "$work/disk.raw"
rm -rf "$root"
say "done"
