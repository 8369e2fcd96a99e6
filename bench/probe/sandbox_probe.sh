#!/usr/bin/env bash
# What the GPU host's kernel allows a sandbox: cgroups, namespaces, seccomp, CUDA inside them.
set -u
echo "== kernel"; uname -r; nproc
echo "== cgroup"; mount | grep -E 'cgroup' ; cat /proc/self/cgroup; ls /sys/fs/cgroup | head -40
cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null && echo v2controllers
cat /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
mkdir /sys/fs/cgroup/ke_probe 2>&1 && ls /sys/fs/cgroup/ke_probe | head -50 && echo "+memory +pids" > /sys/fs/cgroup/cgroup.subtree_control; cat /sys/fs/cgroup/ke_probe/memory.max 2>&1; echo $$ > /sys/fs/cgroup/ke_probe/cgroup.procs 2>&1 && echo moved; cat /proc/self/cgroup; echo $$ > /sys/fs/cgroup/cgroup.procs; rmdir /sys/fs/cgroup/ke_probe
echo "== ns"; for f in user pid net mount; do unshare --$f --fork true 2>&1 && echo "ns $f ok"; done
unshare --user --map-root-user --pid --mount --net --fork --mount-proc sh -c 'id; ls /proc | head -3' 2>&1
echo "== seccomp"; grep -i seccomp /proc/self/status; grep CONFIG_SECCOMP /boot/config-$(uname -r) 2>/dev/null; zcat /proc/config.gz 2>/dev/null | grep -E 'SECCOMP|USER_NS|CGROUP' | head
echo "== dev"; ls -la /dev/nvidia* /dev/dri 2>&1 | head; ls /proc/driver/nvidia 2>&1 | head
echo "== python"; which python3; python3 -c 'import sys;print(sys.prefix, sys.base_prefix)'; id nobody
echo "== cuda as nobody in new mount+pid+net ns"
D=$(mktemp -d); chmod 755 $D
cat > $D/t.py <<'PY'
import time,os
t=time.time(); import torch; t1=time.time(); x=torch.zeros(1,device='cuda'); torch.cuda.synchronize(); print('cuda ok', torch.cuda.get_device_name(0), 'import %.2f ctx %.2f'%(t1-t, time.time()-t1), os.getuid())
PY
unshare --pid --mount --net --fork --mount-proc setpriv --reuid=65534 --regid=65534 --clear-groups --no-new-privs python3 $D/t.py 2>&1 | tail -3
echo "== fork server timings"
python3 - <<'PY' 2>&1 | tail -20
import os, time, torch, triton
print('torch', torch.__version__, 'triton', triton.__version__)
ts=[]
for i in range(6):
    t=time.time(); r,w=os.pipe(); pid=os.fork()
    if pid==0:
        os.close(r); t0=time.time(); torch.zeros(1,device='cuda'); torch.cuda.synchronize()
        a=torch.randn(256,256,device='cuda'); (a@a).sum().item()
        os.write(w, b'%f'%(time.time()-t0)); os._exit(0)
    os.close(w); v=os.read(r,64); os.waitpid(pid,0); ts.append((time.time()-t, float(v)))
print('fork+ctx+cublas', ['%.3f/%.3f'%x for x in ts])
PY
