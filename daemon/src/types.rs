//! The values placement decides on: the node's GPUs and who runs there, what the history
//! knows of pairs and applications, the knobs, and the decision. A leaf: it imports nothing of
//! the daemon, so that the history, placement, the claimer and the simulator all share it.

use std::collections::{BTreeSet, HashMap};

/// A job already running on a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Resident {
    pub job_id: u32,
    pub app: String,
    pub mem_mb: Option<u64>,
    /// Put back in the queue after it ran out of memory beside a partner, those partners'
    /// applications (its admin comment's note): only a job known to fit beside it may join
    /// it ([`crate::put_back`]).
    pub put_back: Option<Vec<String>>,
}

/// One shared GPU as the policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuState {
    pub index: u32,
    pub model: String,
    pub memory_mb: u64,
    pub residents: Vec<Resident>,
}

/// What the history knows about `app` running beside `other` on one GPU model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairEstimate {
    /// Speed of `app` beside `other`, relative to alone.
    pub speed: f64,
    /// Speed of `other` beside `app`.
    pub other_speed: f64,
    /// How many observations the estimate rests on.
    pub observations: u32,
    /// The pair ran out of GPU memory together: never again.
    pub oom: bool,
}

/// What is known of one application on one GPU model beside partners in general.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AppProfile {
    /// Its expected speed beside a typical partner, already weighed against the prior by how
    /// little it rests on, and how many learned pairs it rests on.
    pub base: Option<(f64, u32)>,
    /// How it changes its partners' speeds against their speed beside a typical partner,
    /// already weighed against "not at all" by how little it rests on, and how many learned
    /// pairs it rests on.
    pub impact: Option<(f64, u32)>,
    /// How many of its pairs ran out of memory, and how many were tried (ran or failed).
    pub ooms: (u32, u32),
}

/// Everything one decision reads of the history, loaded before it is scored: placement never
/// reads the database itself, so a history that cannot be read fails the request instead of
/// passing for "nothing known". The daemon's history fills it ([`Wanted`] says with what); the
/// simulator's oracle fills it from the true table.
#[derive(Debug, Clone, Default)]
pub struct Estimates {
    /// GPU model, then application, then partner.
    pairs: HashMap<String, HashMap<String, HashMap<String, PairEstimate>>>,
    /// GPU model, then application.
    apps: HashMap<String, HashMap<String, AppProfile>>,
    /// GPU model: the sum of every learned speed there (both sides of each pair that ran
    /// together), and how many those are.
    learned: HashMap<String, (f64, u32)>,
    /// Pairs never seen together that a claim has put together and whose outcome the history
    /// does not know yet (GPU model, the two applications in order), with the job trying it:
    /// [`crate::claim::Trials`] fills it, placement rules such a pair out meanwhile.
    trying: HashMap<(String, String, String), u32>,
}

impl Estimates {
    /// Adds what is known of `app` beside `other` on `model`.
    pub fn insert_pair(&mut self, model: &str, app: &str, other: &str, estimate: PairEstimate) {
        self.pairs
            .entry(model.to_string())
            .or_default()
            .entry(app.to_string())
            .or_default()
            .insert(other.to_string(), estimate);
    }

    /// Adds what is known of `app` on `model` beside partners in general.
    pub fn insert_app(&mut self, model: &str, app: &str, profile: AppProfile) {
        self.apps
            .entry(model.to_string())
            .or_default()
            .insert(app.to_string(), profile);
    }

    /// The estimate for `app` beside `other` on `model`, if the history has a row for it.
    pub fn pair(&self, model: &str, app: &str, other: &str) -> Option<PairEstimate> {
        self.pairs.get(model)?.get(app)?.get(other).copied()
    }

    /// What is known of `app` on `model` beside partners in general (nothing, if not loaded).
    pub fn app(&self, model: &str, app: &str) -> AppProfile {
        self.apps
            .get(model)
            .and_then(|m| m.get(app))
            .copied()
            .unwrap_or_default()
    }

    /// Adds what was learned of all pairs on `model`: the sum of the learned speeds and how
    /// many those are.
    pub fn insert_learned(&mut self, model: &str, sum: f64, speeds: u32) {
        self.learned.insert(model.to_string(), (sum, speeds));
    }

    /// The job trying `a` beside `b` on `model` (either order), if a claim put such a pair
    /// together and the history does not know yet how it went.
    pub fn trying(&self, model: &str, a: &str, b: &str) -> Option<u32> {
        self.trying.get(&trial_key(model, a, b)).copied()
    }

    /// Marks `a` beside `b` on `model` as being tried by `job` (see [`Self::trying`]).
    pub fn try_pair(&mut self, model: &str, a: &str, b: &str, job: u32) {
        self.trying.insert(trial_key(model, a, b), job);
    }

    /// Every pair being tried, taken out.
    pub fn take_trying(&mut self) -> HashMap<(String, String, String), u32> {
        std::mem::take(&mut self.trying)
    }

    /// What a job is expected to run at beside a partner on `model` when nothing sets the pair
    /// apart: the mean of every speed learned there, weighed against `prior` as
    /// [`CENTER_PRIOR_WEIGHT`] speeds; and how many learned speeds that rests on. Where few
    /// pairs gain, it falls, and pairs never tried stop looking like gains; where most do, it
    /// rises.
    pub fn center(&self, model: &str, prior: f64) -> (f64, u32) {
        let (sum, n) = self.learned.get(model).copied().unwrap_or((0.0, 0));
        (
            (sum + CENTER_PRIOR_WEIGHT * prior) / (f64::from(n) + CENTER_PRIOR_WEIGHT),
            n,
        )
    }
}

/// A pair's key in either order.
pub fn trial_key(model: &str, a: &str, b: &str) -> (String, String, String) {
    let (x, y) = if a <= b { (a, b) } else { (b, a) };
    (model.to_string(), x.to_string(), y.to_string())
}

/// Speeds' worth of weight `unknown_pair_speed` keeps against what a GPU model's learned pairs
/// say of a typical pair.
pub const CENTER_PRIOR_WEIGHT: f64 = 4.0;

/// What a decision will read: the pairs (`model`, `app`, `other`) and the applications
/// (`model`, `app`). Built by [`crate::placement::wanted`] (or by hand, for other questions), loaded by the
/// history into [`Estimates`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Wanted {
    pub pairs: BTreeSet<(String, String, String)>,
    pub apps: BTreeSet<(String, String)>,
}

impl Wanted {
    /// Asks for everything `other` asks for too.
    pub fn extend(&mut self, other: Wanted) {
        self.pairs.extend(other.pairs);
        self.apps.extend(other.apps);
    }

    /// Asks for both sides of every pair of residents of `gpu`.
    pub fn residents(&mut self, gpu: &GpuState) {
        for (i, r) in gpu.residents.iter().enumerate() {
            for o in &gpu.residents[i + 1..] {
                self.pair(&gpu.model, &r.app, &o.app);
            }
        }
    }

    /// Asks for both sides of the pair `a`, `b` on `model`, and for both applications.
    pub fn pair(&mut self, model: &str, a: &str, b: &str) {
        for (x, y) in [(a, b), (b, a)] {
            self.pairs.insert((model.to_string(), x.to_string(), y.to_string()));
            self.apps.insert((model.to_string(), x.to_string()));
        }
    }
}

/// The job to place.
#[derive(Debug, Clone, PartialEq)]
pub struct Newcomer<'a> {
    pub app: &'a str,
    pub mem_mb: Option<u64>,
}

/// Policy knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Knobs {
    /// Jobs per GPU.
    pub slots: u32,
    /// Assumed speed of each side of a pair never seen together.
    pub unknown_pair_speed: f64,
    /// The least predicted gain (jobs' worth of throughput) worth sharing a GPU for: below
    /// it the job is declined and waits for a better partner or a free GPU (0: never).
    pub min_gain: f64,
    /// `policy.share_queue`: a share is claimed only while more jobs wait than this times the
    /// GPUs claimed on times `1 - gain` (0: whatever waits).
    pub share_queue: f64,
    /// `policy.separate_below`: a share that the separation look would give back at once,
    /// measured as it is, is never made ([`crate::placement::separations`]; 0: no such check).
    pub separate_below: f64,
}

/// The policy's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Place {
        gpu: u32,
        corunners: Vec<u32>,
        /// The newcomer's predicted speed.
        predicted_speed: f64,
        /// Predicted change of the node's total normalised throughput.
        gain: f64,
        reason: String,
    },
    Decline {
        reason: String,
        /// False when no GPU here could ever take the job (it needs more memory than the
        /// largest has), so waiting is pointless.
        may_retry: bool,
    },
}
