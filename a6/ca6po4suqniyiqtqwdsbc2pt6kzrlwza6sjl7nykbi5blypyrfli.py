# AOT ID: ['1_inference']
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
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(9L); x0+=static_cast<int64_t>(1L))
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


cpp_fused_add_eq_mul_sum_unsqueeze_1 = async_compile.cpp_pybinding(['float*', 'const float*', 'const int64_t*', 'const float*', 'const float*', 'const float*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(float* in_out_ptr0,
                       const float* in_ptr0,
                       const int64_t* in_ptr1,
                       const float* in_ptr2,
                       const float* in_ptr3,
                       const float* in_ptr4)
{
    std::atomic<int> inductor_cpu_integer_div_error{0};
    inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;
    {
        #pragma GCC ivdep
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(9L); x0+=static_cast<int64_t>(1L))
        {
            for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(32L); x1+=static_cast<int64_t>(8L))
            {
                {
                    if(C10_LIKELY(x1 >= static_cast<int64_t>(0) && x1 < static_cast<int64_t>(32L)))
                    {
                        auto tmp0 = at::vec::Vectorized<float>::loadu(in_out_ptr0 + static_cast<int64_t>(x1 + 32L*x0), static_cast<int64_t>(8));
                        auto tmp1 = in_ptr0[static_cast<int64_t>(2L*x0)];
                        auto tmp2 = in_ptr1[static_cast<int64_t>(2L*x0)];
                        auto tmp7 = in_ptr0[static_cast<int64_t>(1L + 2L*x0)];
                        auto tmp8 = in_ptr1[static_cast<int64_t>(1L + 2L*x0)];
                        auto tmp15 = at::vec::Vectorized<float>::loadu(in_ptr2 + static_cast<int64_t>(x1 + 32L*x0), static_cast<int64_t>(8));
                        auto tmp27 = at::vec::Vectorized<float>::loadu(in_ptr3 + static_cast<int64_t>(x1 + 32L*x0), static_cast<int64_t>(8));
                        auto tmp39 = at::vec::Vectorized<float>::loadu(in_ptr4 + static_cast<int64_t>(x1 + 32L*x0), static_cast<int64_t>(8));
                        auto tmp3 = static_cast<int64_t>(0);
                        auto tmp4 = tmp2 == tmp3;
                        auto tmp5 = c10::convert<float>(tmp4);
                        auto tmp6 = float(tmp1 * tmp5);
                        auto tmp9 = tmp8 == tmp3;
                        auto tmp10 = c10::convert<float>(tmp9);
                        auto tmp11 = float(tmp7 * tmp10);
                        auto tmp12 = float(tmp6 + tmp11);
                        auto tmp13 = at::vec::Vectorized<float>(tmp12);
                        auto tmp14 = tmp0 * tmp13;
                        auto tmp16 = static_cast<int64_t>(1);
                        auto tmp17 = tmp2 == tmp16;
                        auto tmp18 = c10::convert<float>(tmp17);
                        auto tmp19 = float(tmp1 * tmp18);
                        auto tmp20 = tmp8 == tmp16;
                        auto tmp21 = c10::convert<float>(tmp20);
                        auto tmp22 = float(tmp7 * tmp21);
                        auto tmp23 = float(tmp19 + tmp22);
                        auto tmp24 = at::vec::Vectorized<float>(tmp23);
                        auto tmp25 = tmp15 * tmp24;
                        auto tmp26 = tmp14 + tmp25;
                        auto tmp28 = static_cast<int64_t>(2);
                        auto tmp29 = tmp2 == tmp28;
                        auto tmp30 = c10::convert<float>(tmp29);
                        auto tmp31 = float(tmp1 * tmp30);
                        auto tmp32 = tmp8 == tmp28;
                        auto tmp33 = c10::convert<float>(tmp32);
                        auto tmp34 = float(tmp7 * tmp33);
                        auto tmp35 = float(tmp31 + tmp34);
                        auto tmp36 = at::vec::Vectorized<float>(tmp35);
                        auto tmp37 = tmp27 * tmp36;
                        auto tmp38 = tmp26 + tmp37;
                        auto tmp40 = static_cast<int64_t>(3);
                        auto tmp41 = tmp2 == tmp40;
                        auto tmp42 = c10::convert<float>(tmp41);
                        auto tmp43 = float(tmp1 * tmp42);
                        auto tmp44 = tmp8 == tmp40;
                        auto tmp45 = c10::convert<float>(tmp44);
                        auto tmp46 = float(tmp7 * tmp45);
                        auto tmp47 = float(tmp43 + tmp46);
                        auto tmp48 = at::vec::Vectorized<float>(tmp47);
                        auto tmp49 = tmp39 * tmp48;
                        auto tmp50 = tmp38 + tmp49;
                        tmp50.store(in_out_ptr0 + static_cast<int64_t>(x1 + 32L*x0));
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
        arg0_1, arg1_1, arg2_1, arg3_1, arg4_1 = args
        args.clear()
        assert_size_stride(arg0_1, (9, 32), (32, 1), 'input')
        assert_size_stride(arg1_1, (4, 48, 32), (1536, 32, 1), 'input')
        buf0 = empty_strided_cpu((9, 48), (48, 1), torch.float32)
        # Topologically Sorted Source Nodes: [getitem, linear], Original ATen: [aten.select, aten.t, aten.mm]
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg1_1, (32, 48), (1, 32), 0), out=buf0)
        buf4 = empty_strided_cpu((9, 24), (24, 1), torch.float32)
        assert_size_stride(arg4_1, (4, 32, 24), (768, 24, 1), 'input')
        cpp_fused_mul_silu_split_0(buf0, buf4)
        buf5 = empty_strided_cpu((9, 32), (32, 1), torch.float32)
        # Topologically Sorted Source Nodes: [chunk, silu, a, getitem_1, y], Original ATen: [aten.split, aten.silu, aten.mul, aten.select, aten.t, aten.mm]
        extern_kernels.mm(buf4, reinterpret_tensor(arg4_1, (24, 32), (1, 24), 0), out=buf5)
        buf1 = buf0; del buf0  # reuse
        # Topologically Sorted Source Nodes: [getitem_5, linear_2], Original ATen: [aten.select, aten.t, aten.mm]
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg1_1, (32, 48), (1, 32), 1536), out=buf1)
        buf6 = buf4; del buf4  # reuse
        cpp_fused_mul_silu_split_0(buf1, buf6)
        buf7 = empty_strided_cpu((9, 32), (32, 1), torch.float32)
        # Topologically Sorted Source Nodes: [chunk_1, silu_1, a_1, getitem_6, y_1], Original ATen: [aten.split, aten.silu, aten.mul, aten.select, aten.t, aten.mm]
        extern_kernels.mm(buf6, reinterpret_tensor(arg4_1, (24, 32), (1, 24), 768), out=buf7)
        buf2 = buf1; del buf1  # reuse
        # Topologically Sorted Source Nodes: [getitem_10, linear_4], Original ATen: [aten.select, aten.t, aten.mm]
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg1_1, (32, 48), (1, 32), 3072), out=buf2)
        buf8 = buf6; del buf6  # reuse
        cpp_fused_mul_silu_split_0(buf2, buf8)
        buf9 = empty_strided_cpu((9, 32), (32, 1), torch.float32)
        # Topologically Sorted Source Nodes: [chunk_2, silu_2, a_2, getitem_11, y_2], Original ATen: [aten.split, aten.silu, aten.mul, aten.select, aten.t, aten.mm]
        extern_kernels.mm(buf8, reinterpret_tensor(arg4_1, (24, 32), (1, 24), 1536), out=buf9)
        buf3 = buf2; del buf2  # reuse
        # Topologically Sorted Source Nodes: [getitem_15, linear_6], Original ATen: [aten.select, aten.t, aten.mm]
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg1_1, (32, 48), (1, 32), 4608), out=buf3)
        del arg0_1
        del arg1_1
        buf10 = buf8; del buf8  # reuse
        cpp_fused_mul_silu_split_0(buf3, buf10)
        del buf3
        buf11 = empty_strided_cpu((9, 32), (32, 1), torch.float32)
        # Topologically Sorted Source Nodes: [chunk_3, silu_3, a_3, getitem_16, y_3], Original ATen: [aten.split, aten.silu, aten.mul, aten.select, aten.t, aten.mm]
        extern_kernels.mm(buf10, reinterpret_tensor(arg4_1, (24, 32), (1, 24), 2304), out=buf11)
        del arg4_1
        del buf10
        assert_size_stride(arg3_1, (9, 2), (2, 1), 'input')
        assert_size_stride(arg2_1, (9, 2), (2, 1), 'input')
        buf12 = buf5; del buf5  # reuse
        cpp_fused_add_eq_mul_sum_unsqueeze_1(buf12, arg3_1, arg2_1, buf7, buf9, buf11)
        del arg2_1
        del arg3_1
        return (buf12, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = rand_strided((9, 32), (32, 1), device='cpu', dtype=torch.float32)
    arg1_1 = rand_strided((4, 48, 32), (1536, 32, 1), device='cpu', dtype=torch.float32)
    arg2_1 = rand_strided((9, 2), (2, 1), device='cpu', dtype=torch.int64)
    arg3_1 = rand_strided((9, 2), (2, 1), device='cpu', dtype=torch.float32)
    arg4_1 = rand_strided((4, 32, 24), (768, 24, 1), device='cpu', dtype=torch.float32)
    return [arg0_1, arg1_1, arg2_1, arg3_1, arg4_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat, device='cpu')


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
