//! Fused nodes: how a unit's forward becomes **one** graph node whose only graph input is its
//! activation, while its parameters still get their gradients — the seam behind the GPT's and
//! the decoder families' one-node blocks, public for users' own units.
//!
//! # Why
//!
//! Candle's backward keeps one zero-filled accumulator per node input and adds every gradient
//! into it; a transformer block composed of a dozen nodes with twenty-odd inputs pays that in
//! memory traffic, and a custom op takes at most three inputs. A fused node therefore takes only
//! `x` as its graph input and hands its parameters' gradients to a *sink* instead: the FSDP
//! runtime, which back-propagates each unit call on its own, opens a sink around that backward
//! and adds what was sent into the call's gradient store before flattening it, exactly where
//! Candle's gradients would have been (then reduce-scatter, accumulation, the optimizer: all
//! unchanged). A group whose parameters are read only by fused nodes is bound as views of the
//! gathered buffer, without autograd variables (`design/fsdp.md`).
//!
//! # The protocol (per rank thread; a unit's forward and backward run on its rank's thread)
//!
//! - **Forward.** The runtime arms the thread around every training call of a unit. A fused
//!   node may be built only while [`armed`]; it [`promise`]s the parameters whose gradients it
//!   will send (the runtime's connectivity check counts them as reached).
//! - **Backward.** The runtime collects around the call's backward; the node's backward
//!   [`send`]s `(parameter, gradient)` pairs, each a term of that parameter's gradient (terms of
//!   one parameter from several nodes or calls are added).
//!
//! Outside the runtime nothing is armed, and a unit takes its composed path (every gradient
//! through Candle): a fused unit must compute the same function both ways, and must take the
//! same path in every training step (the runtime checks it). Where nothing tracks gradients
//! (an activation-checkpointed forward, evaluation) a fused unit runs its op's forward alone,
//! armed or not: the checkpointed forward and its recompute then compute the same bits.
//!
//! # Two ways to write one
//!
//! - **[`FusedOp`] and [`apply`]**: write the forward and the backward over Candle tensors (any
//!   device; the backward returns the input's and each parameter's gradient); [`apply`] makes the
//!   node, promises and sends. The forward's output is copied once into the node (one pass over
//!   the output, on any device). `examples/fused_unit.rs` trains such a unit under FSDP.
//! - **A Candle `CustomOp1`** over `x` whose `cpu_fwd` runs slice kernels (for instance
//!   [`crate::nn::kernels`]) and whose `bwd` calls [`send`] for each parameter: no copy at all;
//!   the GPT block (`models/decoder/fused/gpt2.rs`) and the decoder block (`models/decoder/fused.rs`) are
//!   built this way. Ask [`fusion`] how to run: build the node and [`promise`] for
//!   [`Fusion::Node`], run the kernels alone for [`Fusion::ForwardOnly`], compose for `None`.
//!
//! # A building block
//!
//! [`Linear`] ([`linear`], [`linear_no_bias`], [`linear_forward`]) is `candle_nn::linear` as such a node:
//! `crate::nn::Linear`'s values and gradients, with the runtime's parameter copies skipped (the
//! MNIST model's layers). Because a first layer's input carries no gradient, it cannot ask
//! `x.track_op()` whether the call records autograd: it asks [`records`], and sends only the
//! gradients of tensors that [`is_call_param`] knows.

use std::cell::RefCell;

use candle_core::{bail, Result, Tensor, TensorId};

mod linear;

pub use linear::{linear, linear_forward, linear_no_bias, Linear};

#[derive(Default)]
struct State {
    /// Nesting depth of [`arm`].
    armed: usize,
    /// Parameters promised by fused nodes built while armed.
    promised: Vec<TensorId>,
    /// The frozen parameters of the armed call (no gradient wanted).
    frozen: Vec<TensorId>,
    /// Every parameter tensor of the armed call's groups, frozen or not ([`is_call_param`]).
    params: Vec<TensorId>,
    /// Whether the armed call records autograd (false for an activation-checkpointed
    /// forward, which runs without it and is recomputed in backward): [`records`].
    records: bool,
    /// Open collections ([`collect`]), innermost last.
    frames: Vec<Vec<(Tensor, Tensor)>>,
    /// The armed call's seed ([`call_seed`]).
    seed: u64,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// While the guard lives, fused nodes may send their parameters' gradients to a sink
/// ([`armed`] is true on this thread). Returned by [`arm`].
#[must_use = "the thread is armed only while the guard lives"]
pub(crate) struct Armed {
    /// The seed of the enclosing armed call, restored on drop.
    outer_seed: u64,
    /// The enclosing armed call's [`records`], restored on drop.
    outer_records: bool,
    /// The lengths of `params` and `frozen` before this arming: its own entries are dropped
    /// with it, so an enclosing call does not see a nested call's tensors as its own.
    outer_lens: (usize, usize),
}

impl Drop for Armed {
    fn drop(&mut self) {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.armed -= 1;
            s.seed = self.outer_seed;
            s.records = self.outer_records;
            s.params.truncate(self.outer_lens.0);
            s.frozen.truncate(self.outer_lens.1);
            if s.armed == 0 {
                s.promised.clear();
            }
        });
    }
}

/// Arms this thread: a training call of a unit whose backward will [`collect`].
#[cfg(test)]
pub(crate) fn arm() -> Armed {
    arm_with_frozen(std::iter::empty(), 0)
}

/// [`arm`], with the call's frozen parameters (frozen twins' tensors), whose gradients a node
/// need not compute ([`trains`]), and the call's `seed` ([`call_seed`]); a call that records
/// autograd, with no parameter known to [`is_call_param`] (the tests of fused blocks).
#[cfg(test)]
pub(crate) fn arm_with_frozen<'a>(
    frozen: impl IntoIterator<Item = &'a Tensor>,
    seed: u64,
) -> Armed {
    arm_call([], frozen.into_iter().map(Tensor::id), seed, true)
}

/// Arms this thread for one training call of a unit: `params` the ids of every parameter tensor
/// of the call's groups ([`is_call_param`]), `frozen` those of its frozen twins ([`trains`]),
/// `seed` the call's seed ([`call_seed`]), `records` whether the call records autograd (false for an
/// activation-checkpointed forward: [`records`]).
pub(crate) fn arm_call(
    params: impl IntoIterator<Item = TensorId>,
    frozen: impl IntoIterator<Item = TensorId>,
    seed: u64,
    records: bool,
) -> Armed {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.armed += 1;
        let outer_lens = (s.params.len(), s.frozen.len());
        s.params.extend(params);
        s.frozen.extend(frozen);
        Armed {
            outer_seed: std::mem::replace(&mut s.seed, seed),
            outer_records: std::mem::replace(&mut s.records, records),
            outer_lens,
        }
    })
}

/// Whether `t` is one of the armed call's parameter tensors (as the runtime bound them:
/// variables or views), by identity: a tensor computed from a parameter (a transpose, a
/// merged LoRA weight) is not. False when the thread is not armed. The runtime adds what the
/// sink receives only into its parameters' gradients, so a node that may be handed something
/// else (a general-purpose layer such as [`Linear`]) should ask this before sending; a node
/// built over known parameters ([`apply`], the decoder blocks) relies on the connectivity
/// check instead.
pub fn is_call_param(t: &Tensor) -> bool {
    STATE.with(|s| {
        let s = s.borrow();
        s.armed > 0 && s.params.contains(&t.id())
    })
}

/// Whether the armed call records autograd: true in a training call's forward and in the
/// recomputation of an activation-checkpointed call in backward, false in the checkpointed
/// call's own forward (which keeps no graph) and when the thread is not armed. A node that
/// hangs from something other than its input (see [`Linear`]) asks this instead of
/// `x.track_op()`.
pub fn records() -> bool {
    STATE.with(|s| {
        let s = s.borrow();
        s.armed > 0 && s.records
    })
}

/// SplitMix64's finaliser (Steele, Lea and Flood 2014): a 64-bit mix of `z`, what call seeds
/// and the masks drawn from them ([`crate::lora::dropout_keep`]) hash with.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The armed training call's seed, `None` outside one: a function of the model's seed, the
/// step, the call's position in it and the rank, the same when activation checkpointing
/// recomputes the call. What a unit's randomness in training (LoRA's dropout,
/// [`crate::lora::LoraConfig::dropout`]) derives from, so that the forward, its
/// recomputation and the backward agree without storing masks.
pub fn call_seed() -> Option<u64> {
    STATE.with(|s| {
        let s = s.borrow();
        (s.armed > 0).then_some(s.seed)
    })
}

/// Whether `param` trains in the armed call: false for a frozen parameter (the runtime's
/// `freeze` / `train_only`, e.g. LoRA's base weights), whose gradient a fused node should
/// neither compute nor [`send`] (that is the saving of a frozen base: no weight-gradient
/// product). True outside an armed call — so ask while building the node (in the unit's
/// forward, on the tensors the constructor got; a detached copy is another tensor) and keep
/// the answer for the backward, as [`apply`] does for [`FusedOp::backward`]'s `trains`.
pub fn trains(param: &Tensor) -> bool {
    STATE.with(|s| !s.borrow().frozen.contains(&param.id()))
}

/// True while this thread runs a training call of a unit inside the FSDP runtime (forward, or
/// an activation-checkpointing recompute): a fused node built now will find a sink open in its
/// backward. False everywhere else (evaluation, plain Candle): compose the unit instead.
pub fn armed() -> bool {
    STATE.with(|s| s.borrow().armed > 0)
}

/// How a fused unit runs a call ([`fusion`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fusion {
    /// One graph node whose parameters' gradients go to the runtime's sink: inside an armed
    /// training call ([`armed`]), for an `x` that carries a gradient. [`promise`] them.
    Node,
    /// The op's forward alone: neither `x` nor a parameter carries a gradient (an
    /// activation-checkpointed forward, evaluation), so it computes what the node computes
    /// (a checkpointed call and its recompute agree bit for bit). No promise.
    ForwardOnly,
}

/// How a fused unit runs on `x` with `params` (the tensors its constructor got), or `None`
/// where it must compose its layers: autograd outside an armed call (no sink to send to), or
/// an `x` without gradient among parameters with one (their gradients would have no node to
/// come from). The one rule of [`apply`] and of the crate's `CustomOp1` blocks.
pub fn fusion<'a>(x: &Tensor, params: impl IntoIterator<Item = &'a Tensor>) -> Option<Fusion> {
    if x.track_op() {
        return armed().then_some(Fusion::Node);
    }
    (!params.into_iter().any(Tensor::track_op)).then_some(Fusion::ForwardOnly)
}

/// Records that a fused node built now will send the gradients of `params` (their ids): call it
/// when building the node, with the tensors the unit read its parameters as (the runtime's
/// bound parameters). Outside an armed call it has no effect (nothing is kept).
pub fn promise<'a>(params: impl IntoIterator<Item = &'a Tensor>) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.armed == 0 {
            return;
        }
        let ids: Vec<TensorId> = params.into_iter().map(Tensor::id).collect();
        s.promised.extend(ids);
    })
}

/// Whether a fused node built since the thread was armed promised `param`'s gradient.
pub(crate) fn promised(param: &Tensor) -> bool {
    STATE.with(|s| s.borrow().promised.contains(&param.id()))
}

/// An open collection of sent gradients; [`Collector::finish`] takes them. Dropping it
/// unfinished (an error on the way) discards them.
#[must_use = "the gradients sent are returned by finish"]
pub(crate) struct Collector {
    depth: usize,
    done: bool,
}

/// Opens a collection on this thread, for the backward of one unit call.
pub(crate) fn collect() -> Collector {
    let depth = STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.frames.push(Vec::new());
        s.frames.len()
    });
    Collector { depth, done: false }
}

impl Collector {
    /// The `(parameter, gradient)` pairs sent since [`collect`], in the order sent.
    pub(crate) fn finish(mut self) -> Vec<(Tensor, Tensor)> {
        self.done = true;
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            debug_assert_eq!(
                s.frames.len(),
                self.depth,
                "collections closed out of order"
            );
            s.frames.pop().unwrap_or_default()
        })
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if !self.done {
            STATE.with(|s| {
                let mut s = s.borrow_mut();
                s.frames.truncate(self.depth - 1);
            });
        }
    }
}

/// Sends `grad` (`param`'s shape and dtype) as a term of `param`'s gradient to the runtime:
/// call it from a fused node's backward, once per parameter (or several times: terms add).
///
/// Errors: no collection is open on this thread (the node was back-propagated outside the
/// FSDP runtime's backward of its unit, e.g. by `loss.backward()` instead of
/// `FsdpModel::backward`).
pub fn send(param: &Tensor, grad: Tensor) -> Result<()> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        match s.frames.last_mut() {
            Some(frame) => {
                frame.push((param.clone(), grad));
                Ok(())
            }
            None => bail!(
                "a fused node's backward ran outside the FSDP runtime's backward of its unit: \
                 its parameters' gradients have nowhere to go (back-propagate through \
                 FsdpModel::backward)"
            ),
        }
    })
}

/// A unit's computation as one fused node, written over Candle tensors: see the module
/// documentation and [`apply`].
///
/// Both methods run without autograd (their inputs are detached): the forward computes the
/// output's value — of `x`'s shape-compatible dtype and device: the node's output keeps the
/// input's dtype and device — and the backward the gradients by hand.
pub trait FusedOp: Send + Sync + 'static {
    /// A name for errors and Candle's graph (`"my-block"`).
    fn name(&self) -> &'static str;

    /// The output for input `x` and parameters `params` (in the order given to [`apply`]).
    /// Anything the backward needs may be kept in `self` (interior mutability: the node is
    /// back-propagated at most once per forward).
    fn forward(&self, x: &Tensor, params: &[Tensor]) -> Result<Tensor>;

    /// The gradients for the output's gradient `grad` (the output's shape): the input's
    /// (`x`'s shape, dtype and device), and each parameter's in `params`' order (`None`: no
    /// gradient, as for a parameter the output does not depend on). `params` hold the values
    /// the runtime gathered again for the backward (the forward's values). `trains[i]` is false
    /// for a frozen parameter (the model's `freeze` / `train_only`, e.g. a LoRA base): return
    /// `None` for it and skip its weight-gradient product (a gradient returned for it is
    /// dropped).
    fn backward(
        &self,
        x: &Tensor,
        params: &[Tensor],
        grad: &Tensor,
        trains: &[bool],
    ) -> Result<(Tensor, Vec<Option<Tensor>>)>;
}

/// `op` applied to `x` as one graph node whose parameters' gradients go to the FSDP runtime
/// (inside an armed training call, [`armed`], for an `x` that carries a gradient); `op`'s
/// forward alone where neither `x` nor a parameter carries one (an activation-checkpointed
/// forward, evaluation: the same values as the node, so a checkpointed unit's forward and its
/// recompute agree bit for bit); or `None` where the caller must compose the unit: autograd
/// outside an armed call, or an `x` without gradient among parameters with one (the
/// parameters' gradients would have no node to come from; for a frozen stem, compose the first
/// unit or let it take the input's gradient).
///
/// `params` are the unit's parameter tensors as its constructor got them from the
/// `VarBuilder`; the output is `op.forward`'s, copied into the node once.
///
/// Errors: `op`'s; a backward whose gradients do not match `x` and `params` in number and
/// shape (naming `op`, the parameter and both shapes); a backward outside the runtime's
/// ([`send`]).
pub fn apply<O: FusedOp>(x: &Tensor, params: &[Tensor], op: O) -> Result<Option<Tensor>> {
    match fusion(x, params) {
        None => return Ok(None),
        Some(Fusion::ForwardOnly) => return op.forward(x, params).map(Some),
        Some(Fusion::Node) => {}
    }
    let detached: Vec<Tensor> = params.iter().map(Tensor::detach).collect();
    let mut value = op.forward(&x.detach(), &detached)?;
    if !value.is_contiguous() {
        // A fresh storage holding exactly the output, read from its start by the node.
        value = value.contiguous()?;
    } else if value.layout().start_offset() != 0 {
        value = value.affine(1.0, 0.0)?;
    }
    if value.device().location() != x.device().location() || value.dtype() != x.dtype() {
        bail!(
            "fused op {}: its forward returned {:?} on {:?}, but the node's input is {:?} on {:?} \
             (a fused node's output keeps its input's dtype and device)",
            op.name(),
            value.dtype(),
            value.device().location(),
            x.dtype(),
            x.device().location()
        )
    }
    promise(params);
    let node = Node {
        op,
        trains: params.iter().map(trains).collect(),
        params: params.to_vec(),
        shape: value.shape().clone(),
        value: std::sync::Mutex::new(Some(value)),
    };
    x.apply_op1(node).map(Some)
}

/// The graph node of [`apply`]: the op, the parameters as bound, the forward's value until the
/// node takes it.
struct Node<O> {
    op: O,
    /// Per parameter: whether it trains ([`trains`], read while the call was armed).
    trains: Vec<bool>,
    params: Vec<Tensor>,
    shape: candle_core::Shape,
    value: std::sync::Mutex<Option<Tensor>>,
}

impl<O: FusedOp> Node<O> {
    fn take(&self) -> Result<Tensor> {
        let v = self.value.lock().unwrap_or_else(|e| e.into_inner()).take();
        v.ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "fused op {}: the node was evaluated twice",
                self.op.name()
            ))
        })
    }
}

impl<O: FusedOp> candle_core::CustomOp1 for Node<O> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(
        &self,
        _s: &candle_core::CpuStorage,
        _l: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        let v = self.take()?;
        let (s, l) = v.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(s) => Ok((s.try_clone(l)?, self.shape.clone())),
            _ => bail!("fused op {}: the output left the CPU", self.op.name()),
        }
    }

    fn cuda_fwd(
        &self,
        _s: &candle_core::CudaStorage,
        _l: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        let v = self.take()?;
        let (s, l) = v.storage_and_layout();
        match &*s {
            candle_core::Storage::Cuda(s) => Ok((s.try_clone(l)?, self.shape.clone())),
            _ => bail!("fused op {}: the output left the GPU", self.op.name()),
        }
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let params: Vec<Tensor> = self.params.iter().map(Tensor::detach).collect();
        let (dx, grads) =
            self.op
                .backward(&arg.detach(), &params, &grad_res.detach(), &self.trains)?;
        let name = self.op.name();
        if dx.shape() != arg.shape()
            || dx.dtype() != arg.dtype()
            || dx.device().location() != arg.device().location()
        {
            bail!(
                "fused op {name}: the input's gradient is {:?} {:?} on {:?}, the input {:?} {:?} \
                 on {:?}",
                dx.shape(),
                dx.dtype(),
                dx.device().location(),
                arg.shape(),
                arg.dtype(),
                arg.device().location()
            )
        }
        if grads.len() != params.len() {
            bail!(
                "fused op {name}: the backward returned {} parameter gradients for {} parameters",
                grads.len(),
                params.len()
            )
        }
        for (i, (p, g)) in self.params.iter().zip(grads).enumerate() {
            let Some(g) = g.filter(|_| self.trains[i]) else {
                continue;
            };
            if g.shape() != p.shape() {
                bail!(
                    "fused op {name}: parameter {i}'s gradient is {:?}, the parameter {:?}",
                    g.shape(),
                    p.shape()
                )
            }
            if g.device().location() != p.device().location() {
                bail!(
                    "fused op {name}: parameter {i}'s gradient is on {:?}, the parameter on {:?}",
                    g.device().location(),
                    p.device().location()
                )
            }
            send(p, g.to_dtype(p.dtype())?)?;
        }
        Ok(Some(dx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn arming_nests_and_collections_return_what_was_sent() {
        let p = Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(!armed());
        {
            let _a = arm();
            let _b = arm();
            promise([&p]);
            assert!(armed() && promised(&p));
        }
        assert!(!armed() && !promised(&p));
        let e = send(&p, p.clone()).unwrap_err().to_string();
        assert!(e.contains("outside the FSDP runtime"), "{e}");
        let outer = collect();
        send(&p, p.ones_like().unwrap()).unwrap();
        let inner = collect();
        send(&p, p.clone()).unwrap();
        drop(inner);
        let got = outer.finish();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1.to_vec1::<f32>().unwrap(), [1.0; 3]);
        assert!(send(&p, p.clone()).is_err());
    }

    /// `records` and `is_call_param` answer for the innermost armed call and come back to the
    /// enclosing call's answers when a nested arming ends; outside any call both are false.
    #[test]
    fn records_and_call_params_follow_the_innermost_call() {
        let t = |v: f32| Tensor::new(&[v], &Device::Cpu).unwrap();
        let (a, b, f) = (t(1.0), t(2.0), t(3.0));
        assert!(!records() && !is_call_param(&a));
        {
            let _outer = arm_call([a.id(), f.id()], [f.id()], 5, false);
            assert!(!records(), "a checkpointed forward records nothing");
            assert!(is_call_param(&a) && is_call_param(&f) && !is_call_param(&b));
            assert!(!trains(&f) && trains(&a));
            assert_eq!(call_seed(), Some(5));
            {
                let _inner = arm_call([b.id()], [], 9, true);
                assert!(records() && is_call_param(&b));
                assert_eq!(call_seed(), Some(9));
            }
            assert!(!records(), "the enclosing call's answer is back");
            assert!(
                !is_call_param(&b),
                "the nested call's parameters left with it"
            );
            assert!(is_call_param(&a) && !trains(&f));
            assert_eq!(call_seed(), Some(5));
        }
        assert!(!records() && !is_call_param(&a) && trains(&f) && !armed());
    }

    /// `apply` with a frozen parameter: the op's backward is told (`trains`), and a gradient
    /// it returns anyway is not sent; the trainable one is, with `dx`.
    #[test]
    fn apply_tells_the_backward_which_parameters_train_and_sends_only_theirs() {
        use candle_core::Var;
        use std::sync::{Arc, Mutex};
        struct Scale(Arc<Mutex<Vec<bool>>>);
        impl FusedOp for Scale {
            fn name(&self) -> &'static str {
                "scale"
            }
            fn forward(&self, x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
                x.broadcast_mul(&p[0])?.broadcast_add(&p[1])
            }
            fn backward(
                &self,
                x: &Tensor,
                p: &[Tensor],
                g: &Tensor,
                trains: &[bool],
            ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
                *self.0.lock().unwrap() = trains.to_vec();
                // Both gradients returned: the frozen one must be dropped.
                Ok((
                    g.broadcast_mul(&p[0])?,
                    vec![Some((g * x)?.sum(0)?), Some(g.sum(0)?)],
                ))
            }
        }
        let w = Var::from_vec(vec![2f32, 3.0], 2, &Device::Cpu).unwrap();
        let b = Var::from_vec(vec![0.5f32, -1.0], 2, &Device::Cpu).unwrap();
        let x = Var::from_vec(vec![1f32, 2.0, 3.0, 4.0], (2, 2), &Device::Cpu).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let armed = arm_with_frozen([w.as_tensor()], 0);
        assert!(!trains(w.as_tensor()) && trains(b.as_tensor()));
        let params = [w.as_tensor().clone(), b.as_tensor().clone()];
        let y = apply(x.as_tensor(), &params, Scale(seen.clone()))
            .unwrap()
            .unwrap();
        drop(armed);
        assert!(
            trains(w.as_tensor()),
            "outside an armed call everything trains"
        );
        let sink = collect();
        let grads = y.sum_all().unwrap().backward().unwrap();
        let sent = sink.finish();
        assert_eq!(*seen.lock().unwrap(), vec![false, true]);
        assert_eq!(sent.len(), 1, "only the trainable parameter's gradient");
        assert_eq!(sent[0].0.id(), b.as_tensor().id());
        assert_eq!(sent[0].1.to_vec1::<f32>().unwrap(), [2.0, 2.0]);
        let dx = grads.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(dx, [[2.0, 3.0], [2.0, 3.0]]);
    }
}
