//! What a model is built from: [`ModelSpec`] (groups of units in build order, freeze
//! patterns), and the built model's callable units ([`Member`]).

use std::collections::HashSet;

use candle_core::DType;

use crate::error::Result;
use crate::unit::{record_unit, RecordedParam, UnitSpec};

/// What a model is built from: groups of units in order, and the freeze patterns. Built by
/// [`super::FsdpModelBuilder`]; a `Vec<UnitSpec>` converts into a chain of single-unit groups.
#[derive(Clone, Default)]
pub struct ModelSpec {
    pub(super) groups: Vec<GroupSpec>,
    pub(super) freeze: Vec<String>,
    /// When not empty: the only trainable parameters (every other one is frozen).
    pub(super) train_only: Vec<String>,
}

#[derive(Clone)]
pub(super) struct GroupSpec {
    /// The prefix of the members' parameter names.
    pub(super) name: String,
    pub(super) members: Vec<UnitSpec>,
}

impl From<Vec<UnitSpec>> for ModelSpec {
    fn from(specs: Vec<UnitSpec>) -> Self {
        let mut m = ModelSpec::default();
        for s in specs {
            m.push_unit(s);
        }
        m
    }
}

impl ModelSpec {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a unit of its own (its parameters are named `<unit name>.<path>`).
    pub fn push_unit(&mut self, spec: UnitSpec) {
        self.groups.push(GroupSpec {
            name: spec.name.clone(),
            members: vec![spec],
        });
    }

    /// Adds a group (see [`super::FsdpModelBuilder::group`]).
    pub fn push_group(&mut self, name: impl Into<String>, members: Vec<UnitSpec>) {
        self.groups.push(GroupSpec {
            name: name.into(),
            members,
        });
    }

    /// Adds freeze patterns (see [`super::FsdpModelBuilder::freeze`]).
    pub fn push_freeze(&mut self, patterns: impl IntoIterator<Item = impl Into<String>>) {
        self.freeze.extend(patterns.into_iter().map(Into::into));
    }

    /// Adds patterns of the only parameters that train (see
    /// [`super::FsdpModelBuilder::train_only`]).
    pub fn push_train_only(&mut self, patterns: impl IntoIterator<Item = impl Into<String>>) {
        self.train_only.extend(patterns.into_iter().map(Into::into));
    }

    /// Every tensor the constructors create (parameters and buffers, each once), in build
    /// order: what a full state dict of this model holds.
    ///
    /// Errors: a constructor that fails.
    pub fn record(&self, device: &candle_core::Device) -> Result<Vec<RecordedParam>> {
        let mut out: Vec<RecordedParam> = Vec::new();
        for g in &self.groups {
            for m in &g.members {
                for p in record_unit(m, &g.name, DType::F32, device)? {
                    if !out.iter().any(|q| q.name == p.name) {
                        out.push(p);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A callable unit: a constructor bound under its group's prefix to the parameters of its
/// groups (its own or its tied group's, plus a frozen twin when some are frozen).
pub(crate) struct Member {
    pub(crate) spec: UnitSpec,
    pub(crate) prefix: String,
    /// Indices into `FsdpModel`'s groups: the group holding the trainable parameters and buffers
    /// first, then the frozen twin if any.
    pub(crate) groups: Vec<usize>,
    /// The full names of the tensors its constructor asks for.
    pub(super) params: HashSet<String>,
}
