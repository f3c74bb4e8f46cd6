"""Micro-benchmark of the kernel's attend/silu_mul against SDPA and F.silu (1 thread; 9 q heads, 3 kv heads, D 64, 300 keys; 1 and 8 rows). Run: python scripts/attend_microbench.py"""
import torch, time
import torch.nn.functional as F
torch.set_num_threads(1)
from selfspec_cli.engine.kernels import load_extension
m = load_extension()
hq,hkv,d,S=9,3,64,512
for n in (300,):
  for t in (1,8):
    qkv=torch.randn(t,(hq+2*hkv)*d)
    k=torch.randn(hkv,S,d); v=torch.randn(hkv,S,d)
    def a(): return m.attend(qkv,hq,k,v,n,None,n-t,0,0)
    q=qkv[:, :hq*d].view(t,hq,d).transpose(0,1).unsqueeze(0)
    mask=torch.zeros(t,n); mask[:, n-t:]=torch.full((t,t),torch.finfo(torch.float32).min).triu(1)
    def b(): return F.scaled_dot_product_attention(q,k[None,:,:n],v[None,:,:n],attn_mask=mask[None,None] if t>1 else None,enable_gqa=True)[0].transpose(0,1).reshape(t,hq*d)
    print(t, (a()-b()).abs().max().item())
    for f,name in ((a,'attend'),(b,'sdpa')):
        for _ in range(50): f()
        t0=time.perf_counter()
        for _ in range(500): f()
        print(name, t, (time.perf_counter()-t0)/500*1e6, 'us')
x=torch.randn(1,3072)
for _ in range(100): m.silu_mul(x)
t0=time.perf_counter()
for _ in range(2000): m.silu_mul(x)
print('silu_mul', (time.perf_counter()-t0)/2000*1e6)
g,u=x.chunk(2,-1)
print((m.silu_mul(x)-F.silu(g)*u).abs().max())
