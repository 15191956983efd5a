//! Units: ordinary candle-nn constructors (`Fn(VarBuilder) -> candle::Result<M>`) whose
//! parameters the runtime owns.
//!
//! A constructor is called in two ways, each through a [`VarBuilder`] whose backend the runtime
//! serves:
//! - **recording** ([`record_unit`]): the backend notes each parameter's name, shape and init
//!   hint in the order the constructor asks for them and hands back a zero-strided placeholder
//!   (no memory), which is how the FlatParameter layout is learnt without materialising anything;
//! - **binding** ([`UnitSpec::bind`]): the backend hands back the unsharded parameters (views of
//!   the gathered flat buffer, or autograd variables in backward), so the module computes with
//!   them. Binding happens at every unshard; for candle-nn layers it only builds small structs.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, ModuleT, VarBuilder};
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// A unit's module with any number of input and output tensors (attention masks, position
/// ids, caches): what [`UnitSpec::multi`] wraps. A candle-nn [`ModuleT`] (one tensor in, one
/// out) is wrapped by [`UnitSpec::new`] instead.
///
/// `xs` are the tensors passed to [`crate::fsdp::Forward::call`], in order; the returned
/// tensors are handed back to the caller in the same order. Float outputs carry gradients;
/// integer outputs are returned as they are.
pub trait UnitModule {
    /// Runs the module; `train` selects training behaviour (dropout, batch statistics).
    ///
    /// Errors: the module's own (shape mismatches, a wrong number of inputs).
    fn forward_t(&self, xs: &[Tensor], train: bool) -> candle_core::Result<Vec<Tensor>>;
}

impl dyn UnitModule {
    /// Runs a unit of one input and one output (a wrapped candle-nn module) on `x`.
    ///
    /// Errors: the module's; a unit that does not return exactly one output.
    pub fn forward1(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let mut out = self.forward_t(std::slice::from_ref(x), train)?;
        match out.len() {
            1 => Ok(out.pop().expect("one output")),
            n => candle_core::bail!("forward1: the unit returned {n} outputs, not one"),
        }
    }
}

/// A [`ModuleT`] seen as a [`UnitModule`] of one input and one output.
struct One<M>(M);

impl<M: ModuleT> UnitModule for One<M> {
    fn forward_t(&self, xs: &[Tensor], train: bool) -> candle_core::Result<Vec<Tensor>> {
        match xs {
            [x] => Ok(vec![self.0.forward_t(x, train)?]),
            _ => candle_core::bail!(
                "this unit takes one input tensor (a candle-nn module), found {}: wrap a module \
                 of several inputs with UnitSpec::multi",
                xs.len()
            ),
        }
    }
}

/// A type-erased unit constructor.
pub type UnitCtor =
    Arc<dyn Fn(VarBuilder) -> candle_core::Result<Box<dyn UnitModule>> + Send + Sync>;

/// A recorded parameter: name, shape, init hint.
#[derive(Debug, Clone)]
pub struct RecordedParam {
    /// Fully qualified name (`<unit>.<path>`).
    pub name: String,
    /// Shape.
    pub shape: Shape,
    /// Init hint the constructor gave.
    pub hint: Init,
}

#[derive(Default, Clone)]
struct Recorder {
    params: Arc<Mutex<Vec<RecordedParam>>>,
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut params = self.params.lock();
        match params.iter().find(|p| p.name == name) {
            Some(p) if p.shape != s => candle_core::bail!(
                "parameter {name} requested twice with different shapes: {:?} then {s:?}",
                p.shape
            ),
            Some(_) => {}
            None => params.push(RecordedParam {
                name: name.to_string(),
                shape: s.clone(),
                hint: h,
            }),
        }
        // A zero-strided placeholder: correct shape and dtype, no memory.
        Tensor::zeros((), dtype, dev)?.broadcast_as(s)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!(
            "parameter {name}: FSDP units must create parameters with a shape \
             (vb.get / vb.get_with_hints), not get_unchecked"
        )
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        false
    }
}

/// Serves bound parameters by name, checking shapes; parameters in the dtype asked for,
/// buffers always as they are (their own `buffer_dtype`, the live variable: never a converted
/// copy, whose in-place updates would be lost).
struct Binder {
    unit: String,
    tensors: HashMap<String, Tensor>,
    buffers: HashSet<String>,
}

impl SimpleBackend for Binder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _h: Init,
        dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, _dev)?;
        if t.shape() != &s {
            candle_core::bail!(
                "unit {}: parameter {name} has shape {:?} but the constructor now asks for {s:?}",
                self.unit,
                t.shape()
            );
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        match self.tensors.get(name) {
            Some(t) if t.dtype() == dtype || self.buffers.contains(name) => Ok(t.clone()),
            Some(t) => t.to_dtype(dtype),
            None => candle_core::bail!(
                "unit {}: the constructor asked for parameter {name}, which it did not create \
                 when it was recorded (constructors must be deterministic)",
                self.unit
            ),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// A named unit constructor.
#[derive(Clone)]
pub struct UnitSpec {
    /// Unit name: what [`crate::fsdp::Forward::call`] calls it by, and the prefix of its
    /// parameter names (`<name>.weight`), unless the unit is a member of a group
    /// ([`crate::FsdpModelBuilder::group`]), whose name is the prefix instead.
    pub name: String,
    /// The constructor.
    pub ctor: UnitCtor,
    /// This unit's own mixed-precision policy (`None`: the model's, see
    /// [`crate::FsdpConfig::mixed_precision`]).
    pub mixed_precision: Option<crate::mixed_precision::MixedPrecision>,
    /// Under FULL_SHARD, free the unit's unsharded parameters after its forward and all-gather
    /// them again just before its backward (default `true`, FSDP2's `reshard_after_forward`).
    /// With `false` the unit keeps them from forward to its backward: more memory, one
    /// all-gather less. The last unit always keeps them.
    pub reshard_after_forward: bool,
    /// Activation checkpointing (default `false`, as in PyTorch): the forward runs without
    /// autograd and keeps only the unit's input; backward recomputes the unit's forward with
    /// autograd. Saves the unit's internal activations at the cost of one more forward. A unit
    /// whose forward is random (dropout) must not be checkpointed: its recompute would draw
    /// other random numbers than the forward that produced the loss. Ignored for the last unit,
    /// whose output feeds the caller's loss (its graph must exist when the loss backward runs).
    pub activation_checkpointing: bool,
}

impl UnitSpec {
    /// Wraps a candle-nn style constructor of a module of one input and one output tensor.
    pub fn new<M, F>(name: impl Into<String>, f: F) -> Self
    where
        M: ModuleT + 'static,
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        let ctor: UnitCtor = Arc::new(move |vb| Ok(Box::new(One(f(vb)?)) as Box<dyn UnitModule>));
        Self::from_ctor(name, ctor)
    }

    /// Wraps a constructor of a module of several input or output tensors ([`UnitModule`]).
    pub fn multi<M, F>(name: impl Into<String>, f: F) -> Self
    where
        M: UnitModule + 'static,
        F: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        let ctor: UnitCtor = Arc::new(move |vb| Ok(Box::new(f(vb)?) as Box<dyn UnitModule>));
        Self::from_ctor(name, ctor)
    }

    fn from_ctor(name: impl Into<String>, ctor: UnitCtor) -> Self {
        Self {
            name: name.into(),
            ctor,
            mixed_precision: None,
            reshard_after_forward: true,
            activation_checkpointing: false,
        }
    }

    /// Sets [`UnitSpec::reshard_after_forward`].
    pub fn with_reshard_after_forward(mut self, reshard: bool) -> Self {
        self.reshard_after_forward = reshard;
        self
    }

    /// Sets [`UnitSpec::activation_checkpointing`].
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.activation_checkpointing = on;
        self
    }

    /// Sets this unit's own mixed-precision policy (e.g. keep a norm layer in f32).
    pub fn with_mixed_precision(mut self, policy: crate::mixed_precision::MixedPrecision) -> Self {
        self.mixed_precision = Some(policy);
        self
    }

    /// Calls the constructor with the parameters `tensors` (keyed by full name), in `dtype`,
    /// under the prefix `prefix` (the unit's name, or its group's).
    ///
    /// Errors: the constructor's own, or a parameter asked for that is not in `tensors`.
    pub fn bind(
        &self,
        prefix: &str,
        tensors: HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Box<dyn UnitModule>> {
        self.bind_with_buffers(prefix, tensors, &HashSet::new(), dtype, device)
    }

    /// As [`UnitSpec::bind`], where the tensors named in `buffers` are served as they are,
    /// whatever dtype the constructor asks for (a buffer keeps its `buffer_dtype` and is the
    /// live variable the module updates in place).
    ///
    /// Errors: as [`UnitSpec::bind`].
    pub fn bind_with_buffers(
        &self,
        prefix: &str,
        tensors: HashMap<String, Tensor>,
        buffers: &HashSet<String>,
        dtype: DType,
        device: &Device,
    ) -> Result<Box<dyn UnitModule>> {
        let binder = Binder {
            unit: self.name.clone(),
            tensors,
            buffers: buffers.clone(),
        };
        let vb = VarBuilder::from_backend(Box::new(binder), dtype, device.clone());
        (self.ctor)(vb.pp(prefix)).map_err(Error::from)
    }
}

/// Runs the constructor once with a recording backend under `prefix` (the unit's name, or its
/// group's) and returns its parameters in creation order. Allocates no parameter memory.
///
/// Errors: the constructor's (named with the unit), e.g. one parameter asked for twice with
/// different shapes.
pub fn record_unit(
    spec: &UnitSpec,
    prefix: &str,
    dtype: DType,
    device: &Device,
) -> Result<Vec<RecordedParam>> {
    let rec = Recorder::default();
    let vb = VarBuilder::from_backend(Box::new(rec.clone()), dtype, device.clone());
    let module = (spec.ctor)(vb.pp(prefix)).map_err(|e| {
        Error::InvalidArgument(format!("unit {}: constructor failed: {e}", spec.name))
    })?;
    drop(module);
    let params = std::mem::take(&mut *rec.params.lock());
    Ok(params)
}
