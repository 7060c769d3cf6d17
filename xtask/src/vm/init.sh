#!/bin/busybox sh
# PID 1 of `cargo xtask vm run` (xtask/src/vm.rs): load the 9p and virtio
# modules, mount the host's root read-only under a tmpfs overlay and the
# checkout read-write at its own path, then run the command as root in the
# checkout, print the exit marker and power off.
/bin/busybox mkdir -p /proc /sys /dev /lower /upper /newroot
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
. /npm-vm/env
fail() {
    echo "npm-vm: $*"
    echo "NPM-VM-EXIT 125"
    reboot -f
}
for m in $(cat /npm-vm/modules); do
    insmod "/npm-vm/modules.d/$m" || fail "insmod $m failed"
done
# Page-cache the read-only host root (nothing in it changes for the guest);
# the checkout is uncached: the host sees the guest's writes at once.
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro hostroot /lower ||
    fail "mounting the host root (9p) failed"
mount -t tmpfs -o mode=0755 tmpfs /upper
mkdir -p /upper/u /upper/w
if ! mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w /newroot; then
    echo "npm-vm: overlay over the host root failed: the root stays read-only"
    mount --bind /lower /newroot
fi
R=/newroot
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t bpf bpffs $R/sys/fs/bpf
mount -t cgroup2 cgroup2 $R/sys/fs/cgroup
mount -t debugfs debugfs $R/sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs $R/sys/kernel/tracing 2>/dev/null
for d in /tmp /run /var/tmp; do
    mount -t tmpfs -o mode=1777 tmpfs $R$d
done
mkdir -p "$R$NPM_VM_CHECKOUT"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 checkout "$R$NPM_VM_CHECKOUT" ||
    fail "mounting the checkout (9p) failed"
# The guest kernel's modules (extracted in the host's cache) where modprobe looks.
# (A guest in another root than the host's, the arm64 one, gets them as
# their own 9p share.)
mkdir -p "$R/lib/modules/$NPM_VM_KVER"
if [ -n "$NPM_VM_MODULES_9P" ]; then
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro modules "$R/lib/modules/$NPM_VM_KVER" ||
        fail "mounting the modules (9p) failed"
else
    mount --bind "$R$NPM_VM_MODULES" "$R/lib/modules/$NPM_VM_KVER" ||
        fail "bind-mounting the modules failed"
fi
# The kernel's module requests (`ip link add … type dummy`) run in the
# initramfs's root: hand them to the host root's modprobe.
printf '#!/bin/sh\nexec chroot /newroot /sbin/modprobe "$@"\n' >/npm-vm/modprobe
chmod 0755 /npm-vm/modprobe
echo /npm-vm/modprobe >/proc/sys/kernel/modprobe
ip link set lo up
hostname npm-vm
cp /npm-vm/cmd $R/run/npm-vm-cmd
cd /
# The command script sets its environment, enters the checkout and execs.
chroot $R /usr/bin/env -i /bin/sh /run/npm-vm-cmd </dev/null
rc=$?
echo "NPM-VM-EXIT $rc"
sync
reboot -f
