//! The host data path of the thread backend: the shared-memory family's collectives
//! (`comm::engine::board`) over this backend's rendezvous, the peers reading each other's tensors
//! through the posted addresses (the GPU data path is `super::cuda`).
//!
//! The output (or in-place buffer) is written through [`Tensor::inplace_op1`] /
//! [`Tensor::inplace_op2`], which hand us `&mut CpuStorage` under the tensor's storage write lock
//! and the input's `&CpuStorage` under its read lock; the whole collective (rendezvous, copy,
//! second barrier) runs inside that call, so both locks are held for as long as peers may touch
//! the buffers. Candle refuses an output that shares storage with its input before calling us;
//! that, and every other local problem (device, shape, layout, dtype), is posted to the
//! rendezvous so that every rank fails with the same [`crate::Error::BadBuffer`].

use super::rendezvous::{AbortOnUnwind, Ctx};
use crate::comm::buffer::{validate, Kind, Post, Problem, RawBuf};
use crate::comm::engine::board::{Board, Expose};
use crate::error::{Error, Result};

/// A rank's side of a thread-backend rendezvous for one collective: the peers read its tensor
/// itself (through the posted address), so nothing is copied before the rendezvous.
pub(super) struct HostBoard<'a> {
    pub ctx: &'a Ctx<'a>,
    /// Every rank's post, after [`Board::publish`].
    posts: Vec<Post>,
}

impl<'a> HostBoard<'a> {
    pub(super) fn new(ctx: &'a Ctx<'a>) -> Self {
        HostBoard {
            ctx,
            posts: Vec::new(),
        }
    }
}

impl Board for HostBoard<'_> {
    fn rank(&self) -> usize {
        self.ctx.rank
    }

    fn world_size(&self) -> usize {
        self.ctx.shared.world_size
    }

    fn seq(&self) -> u64 {
        self.ctx.seq
    }

    fn publish(&mut self, post: &Post, _buf: RawBuf, _expose: Expose) -> Result<u64> {
        let (generation, posts) = self.ctx.rendezvous(*post)?;
        validate(self.ctx.op, self.ctx.shared.world_size, &posts)?;
        self.posts = posts;
        Ok(generation)
    }

    fn readable(&self, j: usize, _like: RawBuf, _len: usize) -> Result<RawBuf> {
        Ok(self.posts[j]
            .input
            .expect("a collective's post has its buffer"))
    }

    /// Cannot fail: every rank passed barrier 1 (see `Ctx::sync`).
    fn sync(&self, target: u64) -> Result<()> {
        self.ctx.sync(target);
        Ok(())
    }

    fn fail_with(&mut self, kind: Kind, problem: Problem) -> Error {
        self.ctx.fail_with(kind, problem)
    }

    fn data_phase(&self) -> impl Sized + '_ {
        AbortOnUnwind(self.ctx.op)
    }
}
