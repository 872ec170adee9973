//! A claim as data: where the claimer pinned a waiting job before Slurm allocated it, beside
//! whom, and how fast it predicted the job would run there. The claimer writes it into the
//! job's admin comment after the tag (`multiplex:app=bert | multiplex: claim node:n1
//! gpu:v100_1 beside:4242 speed:0.83`), a field users cannot set; slurmstepd's plugin hands
//! the comment to the node's daemon, which reads the claim back with [`Claim::from_comment`]:
//! one format, one parser, both ways. Its fields are `key:value`, not `key=value`: in
//! `scontrol show job` a word with `=` reads as a field of the job's own.

use crate::spec::NOTE;
use std::fmt;

/// The first word of a claim's note (what [`crate::spec::with_note`] replaces it by).
pub const KIND: &str = "claim";

/// `gpu:` of a claim for a node only: Slurm picks the GPU there (a job srun made, whose step
/// request must not name a GPU type).
pub const ANY_GPU: &str = "any";

/// One claim.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    /// The node the job was pinned to.
    pub node: String,
    /// The GPU's gres type (`v100_1`); `None`: the node only, Slurm picks the GPU.
    pub gpu: Option<String>,
    /// The jobs the claimer expected beside it on that GPU.
    pub partners: Vec<u32>,
    /// Its predicted speed there, relative to running alone.
    pub predicted_speed: f64,
}

/// Why a claim's note does not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimError {
    /// Not `claim` and its four `key:value` fields.
    Shape(String),
    /// A field that is not a node name, gres type, job list or speed.
    Field { key: &'static str, value: String },
}

impl fmt::Display for ClaimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClaimError::Shape(note) => {
                write!(f, "a claim reads 'claim node:N gpu:T beside:J+J speed:S', not {note:?}")
            }
            ClaimError::Field { key, value } => write!(f, "claim: {key}:{value:?} does not read"),
        }
    }
}

impl std::error::Error for ClaimError {}

/// A node name or gres type as Slurm spells them: letters, digits, `.`, `_`, `-`.
fn is_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

impl Claim {
    /// Reads one note (the text after [`NOTE`]); the inverse of its `Display`.
    pub fn parse(note: &str) -> Result<Claim, ClaimError> {
        let shape = || ClaimError::Shape(note.to_string());
        let mut words = note.split_whitespace();
        if words.next() != Some(KIND) {
            return Err(shape());
        }
        let mut field = |key: &'static str| -> Result<&str, ClaimError> {
            let word = words.next().ok_or_else(shape)?;
            word.strip_prefix(key)
                .and_then(|rest| rest.strip_prefix(':'))
                .ok_or_else(shape)
        };
        let bad = |key: &'static str, value: &str| ClaimError::Field {
            key,
            value: value.to_string(),
        };
        let node = field("node")?;
        let gpu = field("gpu")?;
        let beside = field("beside")?;
        let speed = field("speed")?;
        if words.next().is_some() {
            return Err(shape());
        }
        if !is_name(node) {
            return Err(bad("node", node));
        }
        if !is_name(gpu) {
            return Err(bad("gpu", gpu));
        }
        let partners = match beside {
            "-" => Vec::new(),
            list => list
                .split('+')
                .map(|id| id.parse::<u32>().map_err(|_| bad("beside", beside)))
                .collect::<Result<_, _>>()?,
        };
        let predicted_speed = speed
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .ok_or_else(|| bad("speed", speed))?;
        Ok(Claim {
            node: node.to_string(),
            gpu: (gpu != ANY_GPU).then(|| gpu.to_string()),
            partners,
            predicted_speed,
        })
    }

    /// The claim in a job's admin comment: `None` where it holds none (never claimed, or
    /// claimed by a daemon older than this format); an error for one that does not read
    /// (somebody edited it).
    pub fn from_comment(admin_comment: Option<&str>) -> Option<Result<Claim, ClaimError>> {
        let note = admin_comment?
            .split(NOTE)
            .skip(1)
            .find(|n| n.split_whitespace().next() == Some(KIND))?;
        Some(Claim::parse(note))
    }
}

impl fmt::Display for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let beside = if self.partners.is_empty() {
            "-".to_string()
        } else {
            self.partners.iter().map(u32::to_string).collect::<Vec<_>>().join("+")
        };
        write!(
            f,
            "{KIND} node:{} gpu:{} beside:{beside} speed:{:.2}",
            self.node,
            self.gpu.as_deref().unwrap_or(ANY_GPU),
            self.predicted_speed
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::with_note;

    fn claim(gpu: Option<&str>, partners: &[u32], speed: f64) -> Claim {
        Claim {
            node: "n1".into(),
            gpu: gpu.map(str::to_string),
            partners: partners.to_vec(),
            predicted_speed: speed,
        }
    }

    #[test]
    fn a_claim_reads_back_as_written_in_the_comment() {
        for c in [
            claim(Some("v100_1"), &[], 1.0),
            claim(Some("h100-80gb-hbm3_7"), &[4242], 0.83),
            claim(None, &[3, 4], 0.5),
        ] {
            // No `=`: scontrol show job would read `key=value` as a field of the job's.
            assert!(!c.to_string().contains('='), "{c}");
            let comment = with_note("multiplex:app=bert,mem=4096M", &c.to_string());
            assert_eq!(Claim::from_comment(Some(&comment)), Some(Ok(c.clone())), "{comment}");
        }
        assert_eq!(
            claim(Some("v100_1"), &[4242, 7], 0.834).to_string(),
            "claim node:n1 gpu:v100_1 beside:4242+7 speed:0.83"
        );
    }

    #[test]
    fn a_later_claim_replaces_the_earlier_and_other_notes_stay() {
        let first = with_note("multiplex:app=a", &claim(Some("v100_0"), &[], 1.0).to_string());
        let refused = with_note(&first, "refused: too big");
        let second = with_note(&refused, &claim(Some("v100_1"), &[9], 0.7).to_string());
        assert_eq!(second.matches("claim node:").count(), 1, "{second}");
        assert!(second.contains(" | multiplex: refused: too big"), "{second}");
        assert_eq!(
            Claim::from_comment(Some(&second)).unwrap().unwrap().gpu.as_deref(),
            Some("v100_1")
        );
    }

    #[test]
    fn no_claim_and_a_spoiled_claim_are_told_apart() {
        assert_eq!(Claim::from_comment(None), None);
        assert_eq!(Claim::from_comment(Some("multiplex:app=a")), None);
        assert_eq!(
            Claim::from_comment(Some("multiplex:app=a | multiplex: refused: x")),
            None
        );
        // The tag itself is never read as a claim, whatever its text.
        assert_eq!(Claim::from_comment(Some("claim node:n1 gpu:g beside:- speed:1")), None);
        for (note, key) in [
            ("claim node:n1 gpu:v100_0 beside:x speed:1.00", Some("beside")),
            ("claim node:n1 gpu:v100_0 beside:- speed:fast", Some("speed")),
            ("claim node:n1 gpu:v100_0 beside:- speed:-1", Some("speed")),
            ("claim node:n/1 gpu:v100_0 beside:- speed:1", Some("node")),
            ("claim node:n1 gpu:v100_0 speed:1", None),
            ("claim node:n1 gpu:v100_0 beside:- speed:1 more", None),
            ("claim gpu:v100_0 node:n1 beside:- speed:1", None),
        ] {
            let comment = format!("multiplex:app=a | multiplex: {note}");
            match (Claim::from_comment(Some(&comment)), key) {
                (Some(Err(ClaimError::Field { key: k, .. })), Some(want)) => assert_eq!(k, want, "{note}"),
                (Some(Err(ClaimError::Shape(_))), None) => {}
                (other, _) => panic!("{note}: {other:?}"),
            }
        }
    }
}
