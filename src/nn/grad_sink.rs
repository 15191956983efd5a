//! Parameter gradients handed past Candle's autograd: how a fused node whose only graph input is
//! its activation (a whole transformer block, [`super::block`]) still gives its parameters
//! their gradients.
//!
//! Candle's backward keeps one zero-filled accumulator per node input and adds every gradient
//! into it, and a custom op takes at most three inputs. A block node of twelve parameters
//! therefore takes only `x` as its graph input and hands its parameters' gradients to a
//! *sink* instead: the FSDP runtime, which back-propagates each unit call on its own
//! (`fsdp::backward`), opens a sink around that backward and adds what was sent into the
//! call's gradient store before flattening it, exactly where Candle's gradients would have
//! been.
//!
//! The protocol, per rank thread (ranks are threads, and a unit's forward and backward run on
//! its rank's thread):
//! - **Forward.** The runtime [`arm`]s the thread around a training call of a unit. A fused
//!   node may only be built while armed ([`armed`]); it [`promise`]s the parameters whose
//!   gradients it will send (the runtime's connectivity check counts them as reached).
//! - **Backward.** The runtime [`collect`]s around the call's backward; the node's backward
//!   [`send`]s `(parameter, gradient)` pairs; [`Collector::finish`] returns them.
//!
//! Outside the runtime nothing is armed, and the models take their composed path (one graph
//! node per layer, every gradient through Candle).

use std::cell::RefCell;

use candle_core::{bail, Result, Tensor, TensorId};

#[derive(Default)]
struct State {
    /// Nesting depth of [`arm`].
    armed: usize,
    /// Parameters promised by fused nodes built while armed.
    promised: Vec<TensorId>,
    /// Open collections ([`collect`]), innermost last.
    frames: Vec<Vec<(Tensor, Tensor)>>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// While the guard lives, fused nodes may send their parameters' gradients to a sink
/// ([`armed`] is true on this thread). Returned by [`arm`].
#[must_use = "the thread is armed only while the guard lives"]
pub(crate) struct Armed(());

impl Drop for Armed {
    fn drop(&mut self) {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.armed -= 1;
            if s.armed == 0 {
                s.promised.clear();
            }
        });
    }
}

/// Arms this thread: a training call of a unit whose backward will [`collect`].
pub(crate) fn arm() -> Armed {
    STATE.with(|s| s.borrow_mut().armed += 1);
    Armed(())
}

/// True while this thread is armed: a fused node built now will find a sink open in its
/// backward.
pub(crate) fn armed() -> bool {
    STATE.with(|s| s.borrow().armed > 0)
}

/// Records that a fused node built now will send the gradients of `params` (their ids).
pub(crate) fn promise<'a>(params: impl IntoIterator<Item = &'a Tensor>) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
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

/// Sends `grad` as (a term of) `param`'s gradient to the innermost open collection.
///
/// Errors: no collection is open on this thread (the node was back-propagated outside the
/// FSDP runtime's backward of its unit).
pub(crate) fn send(param: &Tensor, grad: Tensor) -> Result<()> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        match s.frames.last_mut() {
            Some(frame) => {
                frame.push((param.clone(), grad));
                Ok(())
            }
            None => bail!(
                "a fused block's backward ran outside the FSDP runtime's backward of its unit: \
                 its parameters' gradients have nowhere to go (back-propagate through \
                 FsdpModel::backward)"
            ),
        }
    })
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
}
