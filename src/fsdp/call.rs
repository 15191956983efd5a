//! How unit calls join the caller's autograd graph: each training call of a unit becomes a
//! small node of Candle's graph whose backward runs the unit's backward (refill its parameters,
//! back-propagate through its own graph, copy its gradients out, issue its reduce-scatter),
//! PyTorch's `autograd.Function` built from Candle custom ops.
//!
//! One call with tracked inputs `x1 … xk` (float tensors with autograd history) and outputs
//! `o1 … om` becomes:
//!
//! ```text
//!   anchor (a scalar variable of the step)
//!     └─ link1(x1, anchor) ─ link2(x2, link1) ─ … ─ linkk(xk, linkk-1) = top   (scalars)
//!                                                                          ├─ out1(top) = o1's values
//!                                                                          └─ outm(top) = om's values
//! ```
//!
//! Candle back-propagates nodes in reverse topological order, so for one call:
//! 1. every `out_j` that the loss depends on runs first and stores its gradient `g_j`;
//! 2. then `top` runs the unit's backward with all of them
//!    ([`CallBackward::run_call_backward`]):
//!    `sum_j sum(o_j · g_j)` back-propagated through the unit's own graph gives the parameter
//!    gradients and the gradients of the unit's input variables; it returns `xk`'s gradient;
//! 3. the lower links hand out the other inputs' gradients.
//!
//! The graph of the caller's own operations between units (residuals, concatenations) is
//! Candle's as usual, and each call's backward runs exactly when the gradients of all its
//! outputs are complete. The anchor (a variable) makes a call with no tracked input part of the
//! graph; scalars carry zero gradients between the nodes.
//!
//! The nodes reach the runtime through [`StepHook`], and only through the narrow
//! [`CallBackward`] trait (FSDP2's `RegisterPostBackwardFunction` calls the param group, never
//! the root): [`super::FsdpModel::backward`] points the hook of the current step at itself for
//! the duration of `loss.backward()`; a node that runs at any other time (a `loss.backward()`
//! called directly, a graph kept from an earlier step) fails with an error saying so. This
//! module does not know the model type.

use std::sync::Arc;
use std::thread::ThreadId;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// What the nodes of one step's graph call back into (implemented by the model, in
/// `super::backward`): the backward of one call and the gradients the nodes hand over.
pub(crate) trait CallBackward {
    /// Runs the backward of call `c` (by its top node, once the gradients of all its outputs
    /// are stored): refill, back-propagate through the unit's graph, keep the inputs'
    /// gradients, finish the call's groups.
    fn run_call_backward(&mut self, c: usize) -> Result<()>;

    /// Stores the gradient of output `j` of call `c` (by the output node).
    fn set_output_grad(&mut self, c: usize, j: usize, grad: Tensor) -> Result<()>;

    /// Hands out the gradient of tracked input `i` of call `c` (by the input nodes, after the
    /// call's backward); `None` when it got none.
    fn take_input_grad(&mut self, c: usize, i: usize) -> Result<Option<Tensor>>;
}

/// A runtime pointer valid while [`super::FsdpModel::backward`] runs on `thread`.
struct Armed {
    model: *mut dyn CallBackward,
    thread: ThreadId,
}

// SAFETY: the pointer is only dereferenced on `thread`, inside the `FsdpModel::backward` call
// that stored it (see `StepHook::with_model`).
unsafe impl Send for Armed {}

/// The link between one training step's graph nodes and the model (see the module docs).
#[derive(Default)]
pub(crate) struct StepHook {
    armed: Mutex<Option<Armed>>,
    /// The first error a node raised, with its context (Candle's error type cannot carry ours).
    error: Mutex<Option<Error>>,
    /// The step is over (back-propagated or dropped): its nodes are stale.
    ended: std::sync::atomic::AtomicBool,
}

impl StepHook {
    /// Points the hook at `model` until the returned guard drops. Called by
    /// `FsdpModel::backward` around `loss.backward()`, with a pointer derived from its
    /// `&mut self`.
    pub(crate) fn arm(self: &Arc<Self>, model: *mut dyn CallBackward) -> Disarm {
        *self.armed.lock() = Some(Armed {
            model,
            thread: std::thread::current().id(),
        });
        Disarm(self.clone())
    }

    /// Marks the step over: its nodes' backward now says they are stale.
    pub(crate) fn end(&self) {
        self.ended.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The error a node raised during the last backward, if any.
    pub(crate) fn take_error(&self) -> Option<Error> {
        self.error.lock().take()
    }

    /// Runs `f` on the model this hook is armed with.
    fn with_model<R>(
        &self,
        f: impl FnOnce(&mut dyn CallBackward) -> Result<R>,
    ) -> candle_core::Result<R> {
        let ptr = match &*self.armed.lock() {
            Some(a) if a.thread == std::thread::current().id() => a.model,
            _ if self.ended.load(std::sync::atomic::Ordering::Relaxed) => candle_core::bail!(
                "candle-fsdp: this loss uses outputs of an earlier training forward of an \
                 FsdpModel, whose step is over (back-propagated, dropped or replaced): compute \
                 the loss from the outputs of the latest training forward"
            ),
            _ => candle_core::bail!(
                "candle-fsdp: this loss depends on the outputs of an FsdpModel training forward; \
                 back-propagate it with FsdpModel::backward(&loss) (not loss.backward()), once, \
                 before the next training forward"
            ),
        };
        // SAFETY: `FsdpModel::backward` armed the hook with a pointer derived from its
        // `&mut self` and does not use `self` until `loss.backward()` returns and the guard
        // disarms the hook; Candle runs the nodes' backward synchronously on that thread (checked
        // above), so this is the only live access to the model.
        let model = unsafe { &mut *ptr };
        f(model).map_err(|e| {
            let msg = e.to_string();
            let mut slot = self.error.lock();
            if slot.is_none() {
                *slot = Some(e);
            }
            candle_core::Error::Msg(msg)
        })
    }
}

/// Disarms a [`StepHook`] when dropped.
pub(crate) struct Disarm(Arc<StepHook>);

impl Drop for Disarm {
    fn drop(&mut self) {
        *self.0.armed.lock() = None;
    }
}

/// A scalar f32 zero on `t`'s device (the gradient carried between a call's scalar nodes).
fn zero_like_scalar(t: &Tensor) -> candle_core::Result<Tensor> {
    Tensor::zeros((), DType::F32, t.device())
}

/// A scalar f32 zero (the value of a call's scalar nodes).
fn scalar_storage() -> (CpuStorage, Shape) {
    (CpuStorage::F32(vec![0.0]), Shape::from(()))
}

/// The top node of a call without tracked inputs (`top = call(anchor)`).
struct Top {
    hook: Arc<StepHook>,
    call: usize,
}

impl CustomOp1 for Top {
    fn name(&self) -> &'static str {
        "fsdp-call"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok(scalar_storage())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::scalar_storage(s)
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> candle_core::Result<Option<Tensor>> {
        // The anchor is a variable: it needs no gradient.
        self.hook.with_model(|m| m.run_call_backward(self.call))?;
        Ok(None)
    }
}

/// Link `i` of a call: carries tracked input `i`; the top link runs the unit's backward.
struct Link {
    hook: Arc<StepHook>,
    call: usize,
    input: usize,
    top: bool,
}

impl CustomOp2 for Link {
    fn name(&self) -> &'static str {
        "fsdp-call-input"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok(scalar_storage())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::scalar_storage(s)
    }

    fn bwd(
        &self,
        x: &Tensor,
        prev: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = self.hook.with_model(|m| {
            if self.top {
                m.run_call_backward(self.call)?;
            }
            m.take_input_grad(self.call, self.input)
        })?;
        // Candle expects a gradient for every tracked non-variable argument.
        let grad = match grad {
            Some(g) => g,
            None => x.zeros_like()?,
        };
        let prev_grad = if prev.is_variable() {
            None
        } else {
            Some(zero_like_scalar(prev)?)
        };
        Ok((Some(grad), prev_grad))
    }
}

/// Output `j` of a call: its value is the unit's output (copied once, when the node is made);
/// its backward stores the output's gradient for the call's backward.
struct Output {
    hook: Arc<StepHook>,
    call: usize,
    output: usize,
    /// The unit's output (detached), taken by the forward.
    value: Mutex<Option<Tensor>>,
}

impl CustomOp1 for Output {
    fn name(&self) -> &'static str {
        "fsdp-call-output"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some(value) = self.value.lock().take() else {
            candle_core::bail!("fsdp-call-output: forward run twice")
        };
        let (storage, layout) = value.storage_and_layout();
        let candle_core::Storage::Cpu(src) = &*storage else {
            candle_core::bail!("fsdp-call-output: the unit's output is not on the CPU")
        };
        // SAFETY: `copy_strided_src` writes every element of the new storage.
        let mut dst = unsafe {
            candle_core::cpu_backend::CpuDevice.alloc_uninit(layout.shape(), value.dtype())?
        };
        src.copy_strided_src(&mut dst, 0, layout)?;
        Ok((dst, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let Some(value) = self.value.lock().take() else {
            candle_core::bail!("fsdp-call-output: forward run twice")
        };
        cuda::copy_of(&value)
    }

    fn bwd(&self, top: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.hook
            .with_model(|m| m.set_output_grad(self.call, self.output, grad.clone()))?;
        Ok(Some(zero_like_scalar(top)?))
    }
}

/// The CUDA forwards of the nodes: a scalar zero, and a copy of the unit's output (one strided
/// device copy on the compute stream, as on the CPU).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::{BackendDevice, BackendStorage};
    use candle_core::{CudaStorage, DType, Shape, Tensor};

    pub(super) fn scalar_storage(like: &CudaStorage) -> candle_core::Result<(CudaStorage, Shape)> {
        let shape = Shape::from(());
        Ok((like.device.zeros_impl(&shape, DType::F32)?, shape))
    }

    pub(super) fn copy_of(value: &Tensor) -> candle_core::Result<(CudaStorage, Shape)> {
        let (storage, layout) = value.storage_and_layout();
        let candle_core::Storage::Cuda(src) = &*storage else {
            candle_core::bail!("fsdp-call-output: the unit's output is not on the GPU")
        };
        // SAFETY: `copy_strided_src` writes every element of the new storage.
        let mut dst = unsafe { src.device.alloc_uninit(layout.shape(), value.dtype())? };
        src.copy_strided_src(&mut dst, 0, layout)?;
        Ok((dst, layout.shape().clone()))
    }
}

/// Joins call `call` to the caller's graph (see the module docs): `tracked` are the call's
/// tracked inputs as the caller passed them, `outputs` the unit's float outputs (`None` for
/// outputs handed back as they are). Returns the output nodes in place of the float outputs.
///
/// Errors: Candle's (an output on a device without an implementation).
pub(crate) fn stitch(
    hook: &Arc<StepHook>,
    call: usize,
    anchor: &Tensor,
    tracked: &[Tensor],
    outputs: Vec<Tensor>,
    differentiable: &[bool],
) -> candle_core::Result<Vec<Tensor>> {
    let top = if tracked.is_empty() {
        anchor.apply_op1(Top {
            hook: hook.clone(),
            call,
        })?
    } else {
        let mut node = anchor.clone();
        for (i, x) in tracked.iter().enumerate() {
            node = x.apply_op2(
                &node,
                Link {
                    hook: hook.clone(),
                    call,
                    input: i,
                    top: i + 1 == tracked.len(),
                },
            )?;
        }
        node
    };
    outputs
        .into_iter()
        .zip(differentiable)
        .enumerate()
        .map(|(j, (o, &diff))| {
            if !diff {
                return Ok(o);
            }
            top.apply_op1(Output {
                hook: hook.clone(),
                call,
                output: j,
                value: Mutex::new(Some(o.detach())),
            })
        })
        .collect()
}

/// A scalar whose gradient with respect to `o` is `g`: the root of a unit's own backward
/// (`loss.backward()` of the unit's graph, `g` the gradient its outputs received), standing for
/// `Σ o ⊙ g`.
///
/// On the CPU, with `o` and `g` contiguous and of one shape and dtype, it is one graph node
/// ([`SeedOp`]) whose value is 0 (the value of the surrogate is never read: only its gradient
/// is) and whose backward returns `g` itself (scaled only when the root gradient is not 1).
/// Composed as `(o · g).sum_all()` it costs a product tensor and a sum in the forward, and a
/// broadcast, a product and two zero-filled accumulators the size of `o` in the backward, for
/// each unit output of each step. Elsewhere (GPU, other layouts) it is that composition.
pub(crate) fn grad_seed(o: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    let g = g.to_dtype(o.dtype())?;
    let fused = o.device().is_cpu()
        && o.shape() == g.shape()
        && o.is_contiguous()
        && g.is_contiguous()
        && matches!(o.dtype(), DType::F32 | DType::BF16 | DType::F16);
    if fused {
        o.apply_op2(&g, SeedOp)
    } else {
        (o * g)?.sum_all()?.to_dtype(DType::F32)
    }
}

/// See [`grad_seed`]: `(o, g) ↦ 0` (f32 scalar), gradient `(g · grad, none)`.
struct SeedOp;

impl CustomOp2 for SeedOp {
    fn name(&self) -> &'static str {
        "fsdp-grad-seed"
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    fn bwd(
        &self,
        _o: &Tensor,
        g: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let scale = grad_res.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let dg = if scale == 1.0 {
            g.clone()
        } else {
            g.affine(scale as f64, 0.0)?
        };
        Ok((Some(dg), None))
    }
}
