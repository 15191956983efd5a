//! Parameter groups ([`ParamGroup`]): which parameters a group's hyper-parameters apply to,
//! by glob patterns over full parameter names.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A parameter group: the parameters whose full name matches one of `patterns` (glob: `*`
/// matches any run of characters, `?` one character; the whole name must match), stepped with
/// `config`. Groups are tried in order; parameters no group matches belong to the default
/// group (index 0, named `default`, whose patterns are empty).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamGroup<C> {
    /// Name of the group (in errors and checkpoints).
    pub name: String,
    /// Name patterns selecting the group's parameters.
    pub patterns: Vec<String>,
    /// The group's hyper-parameters.
    pub config: C,
}

/// Group `group` of `groups`, or an error naming how many there are.
pub(super) fn group_mut<C>(
    groups: &mut [ParamGroup<C>],
    group: usize,
) -> Result<&mut ParamGroup<C>> {
    let n = groups.len();
    groups.get_mut(group).ok_or_else(|| {
        Error::out_of_range("parameter group", group, "the optimizer's group count", n)
    })
}

impl<C> ParamGroup<C> {
    /// A group named `name` of the parameters matching any of `patterns`.
    pub fn new(
        name: impl Into<String>,
        patterns: impl IntoIterator<Item = impl Into<String>>,
        config: C,
    ) -> Self {
        Self {
            name: name.into(),
            patterns: patterns.into_iter().map(Into::into).collect(),
            config,
        }
    }

    /// Whether `param` (a full parameter name) matches one of the group's patterns.
    pub fn matches(&self, param: &str) -> bool {
        self.patterns.iter().any(|p| glob_match(p, param))
    }
}

/// Glob match of the whole of `name` against `pattern` (`*`: any run, `?`: one character,
/// `[abc]`: a class), with the `glob` crate's syntax, as `FsdpModelBuilder::freeze`. An invalid
/// pattern matches nothing.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    glob::Pattern::new(pattern).is_ok_and(|p| p.matches(name))
}

/// The default group index 0 followed by `groups`.
pub(super) fn with_default<C>(default: C, groups: Vec<ParamGroup<C>>) -> Vec<ParamGroup<C>> {
    let mut all = vec![ParamGroup {
        name: "default".into(),
        patterns: Vec::new(),
        config: default,
    }];
    all.extend(groups);
    all
}

/// The group of parameter `name`: the first group after the default whose patterns match it,
/// else 0.
pub(super) fn group_of<C>(groups: &[ParamGroup<C>], name: &str) -> usize {
    groups
        .iter()
        .enumerate()
        .skip(1)
        .find(|(_, g)| g.matches(name))
        .map_or(0, |(i, _)| i)
}
