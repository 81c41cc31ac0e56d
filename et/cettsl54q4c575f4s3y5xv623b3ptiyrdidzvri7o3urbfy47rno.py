# AOT ID: ['0_inference']
from ctypes import c_void_p, c_long, c_int
import torch
import math
import random
import os
import tempfile
from math import inf, nan
from cmath import nanj
from torch._inductor.hooks import run_intermediate_hooks
from torch._inductor.utils import maybe_profile
from torch._inductor.codegen.memory_planning import _align as align
from torch import device, empty_strided
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels

aten = torch.ops.aten
inductor_ops = torch.ops.inductor
_quantized = torch.ops._quantized
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
assert_alignment = torch._C._dynamo.guards.assert_alignment
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
empty_strided_cpu_pinned = torch._C._dynamo.guards._empty_strided_cpu_pinned
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda
empty_strided_xpu = torch._C._dynamo.guards._empty_strided_xpu
empty_strided_mtia = torch._C._dynamo.guards._empty_strided_mtia
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
alloc_from_pool = torch.ops.inductor._alloc_from_pool
async_compile = AsyncCompile()
empty_strided_p2p = torch._C._distributed_c10d._SymmetricMemory.empty_strided_p2p


cpp_fused_mul_silu_split_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0)
{
    std::atomic<int> inductor_cpu_integer_div_error{0};
    inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;
    {
        #pragma GCC ivdep
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(18L); x0+=static_cast<int64_t>(1L))
        {
            for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(24L); x1+=static_cast<int64_t>(8L))
            {
                {
                    if(C10_LIKELY(x1 >= static_cast<int64_t>(0) && x1 < static_cast<int64_t>(24L)))
                    {
                        auto tmp0 = at::vec::Vectorized<float>::loadu(in_ptr0 + static_cast<int64_t>(x1 + 48L*x0), static_cast<int64_t>(8));
                        auto tmp7 = at::vec::Vectorized<float>::loadu(in_ptr0 + static_cast<int64_t>(24L + x1 + 48L*x0), static_cast<int64_t>(8));
                        auto tmp1 = tmp0.neg();
                        auto tmp2 = tmp1.exp();
                        auto tmp3 = static_cast<float>(1.0);
                        auto tmp4 = at::vec::Vectorized<float>(tmp3);
                        auto tmp5 = tmp2 + tmp4;
                        auto tmp6 = tmp0 / tmp5;
                        auto tmp8 = tmp6 * tmp7;
                        tmp8.store(out_ptr0 + static_cast<int64_t>(x1 + 24L*x0));
                    }
                }
            }
        }
    }
    inductor_cpu_integer_div_error_flag = nullptr;
    inductor_cpu_throw_if_integer_div_error(inductor_cpu_integer_div_error);
}
''')


cpp_fused_arange_bitwise_and_ge_lt_select_unsqueeze_where_zeros_like_1 = async_compile.cpp_pybinding(['float*', 'const int64_t*', 'const float*', 'const float*', 'const float*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(float* in_out_ptr0,
                       const int64_t* in_ptr0,
                       const float* in_ptr1,
                       const float* in_ptr2,
                       const float* in_ptr3)
{
    std::atomic<int> inductor_cpu_integer_div_error{0};
    inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;
    {
        #pragma GCC ivdep
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(18L); x0+=static_cast<int64_t>(1L))
        {
            for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(32L); x1+=static_cast<int64_t>(8L))
            {
                {
                    if(C10_LIKELY(x1 >= static_cast<int64_t>(0) && x1 < static_cast<int64_t>(32L)))
                    {
                        auto tmp0 = in_ptr0[static_cast<int64_t>(3L)];
                        auto tmp4 = in_ptr0[static_cast<int64_t>(4L)];
                        auto tmp7 = at::vec::Vectorized<float>::loadu(in_out_ptr0 + static_cast<int64_t>(x1 + 32L*x0), static_cast<int64_t>(8));
                        auto tmp8 = in_ptr0[static_cast<int64_t>(2L)];
                        auto tmp12 = at::vec::Vectorized<float>::loadu(in_ptr1 + static_cast<int64_t>(x1 + 32L*x0), static_cast<int64_t>(8));
                        auto tmp13 = in_ptr0[static_cast<int64_t>(1L)];
                        auto tmp17 = at::vec::Vectorized<float>::loadu(in_ptr2 + static_cast<int64_t>(x1 + 32L*x0), static_cast<int64_t>(8));
                        auto tmp18 = in_ptr0[static_cast<int64_t>(0L)];
                        auto tmp22 = at::vec::Vectorized<float>::loadu(in_ptr3 + static_cast<int64_t>(x1 + 32L*x0), static_cast<int64_t>(8));
                        auto tmp1 = x0;
                        auto tmp2 = c10::convert<int64_t>(tmp1);
                        auto tmp3 = tmp2 >= tmp0;
                        auto tmp5 = tmp2 < tmp4;
                        auto tmp6 = decltype(tmp3)(tmp3 & tmp5);
                        auto tmp9 = tmp2 >= tmp8;
                        auto tmp10 = tmp2 < tmp0;
                        auto tmp11 = decltype(tmp9)(tmp9 & tmp10);
                        auto tmp14 = tmp2 >= tmp13;
                        auto tmp15 = tmp2 < tmp8;
                        auto tmp16 = decltype(tmp14)(tmp14 & tmp15);
                        auto tmp19 = tmp2 >= tmp18;
                        auto tmp20 = tmp2 < tmp13;
                        auto tmp21 = decltype(tmp19)(tmp19 & tmp20);
                        auto tmp23 = static_cast<float>(0.0);
                        auto tmp24 = at::vec::VecMask<float,1>::from(tmp21);
                        auto tmp25 = at::vec::Vectorized<float>(tmp23);
                        auto tmp26 = decltype(tmp22)::blendv(tmp25, tmp22, tmp24.template cast<float,1>());
                        auto tmp27 = at::vec::VecMask<float,1>::from(tmp16);
                        auto tmp28 = decltype(tmp17)::blendv(tmp26, tmp17, tmp27.template cast<float,1>());
                        auto tmp29 = at::vec::VecMask<float,1>::from(tmp11);
                        auto tmp30 = decltype(tmp12)::blendv(tmp28, tmp12, tmp29.template cast<float,1>());
                        auto tmp31 = at::vec::VecMask<float,1>::from(tmp6);
                        auto tmp32 = decltype(tmp7)::blendv(tmp30, tmp7, tmp31.template cast<float,1>());
                        tmp32.store(in_out_ptr0 + static_cast<int64_t>(x1 + 32L*x0));
                    }
                }
            }
        }
    }
    inductor_cpu_integer_div_error_flag = nullptr;
    inductor_cpu_throw_if_integer_div_error(inductor_cpu_integer_div_error);
}
''')


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def recursively_apply_fns(self, fns):
        new_callables = []
        for fn, c in zip(fns, self.partitions):
            new_callables.append(fn(c))
        self.partitions = new_callables

    def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1 = args
        args.clear()
        assert_size_stride(arg0_1, (18, 32), (32, 1), 'input')
        assert_size_stride(arg3_1, (4, 48, 32), (1536, 32, 1), 'input')
        buf0 = empty_strided_cpu((18, 48), (48, 1), torch.float32)
        # Topologically Sorted Source Nodes: [getitem_3, linear], Original ATen: [aten.select, aten.t, aten.mm]
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg3_1, (32, 48), (1, 32), 0), out=buf0)
        buf10 = empty_strided_cpu((18, 24), (24, 1), torch.float32)
        assert_size_stride(arg2_1, (4, 32, 24), (768, 24, 1), 'input')
        cpp_fused_mul_silu_split_0(buf0, buf10)
        buf11 = empty_strided_cpu((18, 32), (32, 1), torch.float32)
        # Topologically Sorted Source Nodes: [chunk, silu, a, getitem_4, y_1], Original ATen: [aten.split, aten.silu, aten.mul, aten.select, aten.t, aten.mm]
        extern_kernels.mm(buf10, reinterpret_tensor(arg2_1, (24, 32), (1, 24), 0), out=buf11)
        buf1 = buf0; del buf0  # reuse
        # Topologically Sorted Source Nodes: [getitem_9, linear_2], Original ATen: [aten.select, aten.t, aten.mm]
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg3_1, (32, 48), (1, 32), 1536), out=buf1)
        buf8 = buf10; del buf10  # reuse
        cpp_fused_mul_silu_split_0(buf1, buf8)
        buf9 = empty_strided_cpu((18, 32), (32, 1), torch.float32)
        # Topologically Sorted Source Nodes: [chunk_1, silu_1, a_1, getitem_10, y_3], Original ATen: [aten.split, aten.silu, aten.mul, aten.select, aten.t, aten.mm]
        extern_kernels.mm(buf8, reinterpret_tensor(arg2_1, (24, 32), (1, 24), 768), out=buf9)
        buf2 = buf1; del buf1  # reuse
        # Topologically Sorted Source Nodes: [getitem_15, linear_4], Original ATen: [aten.select, aten.t, aten.mm]
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg3_1, (32, 48), (1, 32), 3072), out=buf2)
        buf6 = buf8; del buf8  # reuse
        cpp_fused_mul_silu_split_0(buf2, buf6)
        buf7 = empty_strided_cpu((18, 32), (32, 1), torch.float32)
        # Topologically Sorted Source Nodes: [chunk_2, silu_2, a_2, getitem_16, y_5], Original ATen: [aten.split, aten.silu, aten.mul, aten.select, aten.t, aten.mm]
        extern_kernels.mm(buf6, reinterpret_tensor(arg2_1, (24, 32), (1, 24), 1536), out=buf7)
        buf3 = buf2; del buf2  # reuse
        # Topologically Sorted Source Nodes: [getitem_21, linear_6], Original ATen: [aten.select, aten.t, aten.mm]
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg3_1, (32, 48), (1, 32), 4608), out=buf3)
        del arg0_1
        del arg3_1
        buf4 = buf6; del buf6  # reuse
        cpp_fused_mul_silu_split_0(buf3, buf4)
        del buf3
        buf5 = empty_strided_cpu((18, 32), (32, 1), torch.float32)
        # Topologically Sorted Source Nodes: [chunk_3, silu_3, a_3, getitem_22, y_7], Original ATen: [aten.split, aten.silu, aten.mul, aten.select, aten.t, aten.mm]
        extern_kernels.mm(buf4, reinterpret_tensor(arg2_1, (24, 32), (1, 24), 2304), out=buf5)
        del arg2_1
        del buf4
        assert_size_stride(arg1_1, (5, ), (1, ), 'input')
        buf12 = buf5; del buf5  # reuse
        cpp_fused_arange_bitwise_and_ge_lt_select_unsqueeze_where_zeros_like_1(buf12, arg1_1, buf7, buf9, buf11)
        del arg1_1
        return (buf12, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = rand_strided((18, 32), (32, 1), device='cpu', dtype=torch.float32)
    arg1_1 = rand_strided((5, ), (1, ), device='cpu', dtype=torch.int64)
    arg2_1 = rand_strided((4, 32, 24), (768, 24, 1), device='cpu', dtype=torch.float32)
    arg3_1 = rand_strided((4, 48, 32), (1536, 32, 1), device='cpu', dtype=torch.float32)
    return [arg0_1, arg1_1, arg2_1, arg3_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat, device='cpu')


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
