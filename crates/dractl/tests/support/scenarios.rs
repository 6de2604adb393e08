//! A seeded, deterministic generator of allocation scenarios: nodes, DeviceClasses,
//! ResourceSlices and ResourceClaims (in-use and to allocate) as `resource.k8s.io/v1` JSON,
//! covering the structured allocator's features alone and combined. Every scenario is valid
//! API input: the oracle refusing one is a generator bug.

use serde_json::{Value, json};

/// A small PCG-style generator (no dependency, stable across platforms).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut r = Rng(seed ^ 0x9e37_79b9_7f4a_7c15);
        r.next();
        r
    }
    pub fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// lo..=hi.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
    pub fn uuid(&mut self) -> String {
        let a = self.next();
        let b = self.next();
        let h = format!("{a:016x}{b:016x}");
        format!(
            "{}-{}-4{}-8{}-{}",
            &h[0..8],
            &h[8..12],
            &h[13..16],
            &h[17..20],
            &h[20..32]
        )
    }
}

/// One scenario: the objects (in input order) and the features it exercises.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub id: String,
    pub objects: Vec<Value>,
    pub tags: Vec<&'static str>,
}

const GPU: &str = "gpu.example.com";
const NIC: &str = "nic.example.com";
const MODELS: [&str; 3] = ["A100", "H100", "L4"];
const VERSIONS: [&str; 4] = ["1.0.0", "1.2.0", "1.10.3", "2.0.0-rc.1"];
const MEMORY: [i64; 3] = [24, 40, 80];

/// What the generator knows about a device it put in a slice (for in-use claims).
#[derive(Clone, Debug)]
struct Dev {
    driver: &'static str,
    pool: String,
    name: String,
    shareable: bool,
    /// Gi of memory, for consumed capacity.
    memory: Option<i64>,
}

struct Builder {
    rng: Rng,
    objects: Vec<Value>,
    tags: Vec<&'static str>,
    nodes: Vec<String>,
    drivers: Vec<&'static str>,
    devices: Vec<Dev>,
    classes: Vec<(String, &'static str)>,
    taints: bool,
    consumable: bool,
    slice_n: usize,
}

/// Generates scenario `index` of the run seeded with `seed`.
pub fn scenario(seed: u64, index: u64) -> Scenario {
    let mut b = Builder {
        rng: Rng::new(seed.wrapping_mul(0x1000_0000_01b3).wrapping_add(index)),
        objects: Vec::new(),
        tags: Vec::new(),
        nodes: Vec::new(),
        drivers: vec![GPU],
        devices: Vec::new(),
        classes: Vec::new(),
        taints: false,
        consumable: false,
        slice_n: 0,
    };
    b.build();
    Scenario {
        id: format!("{seed}/{index}"),
        objects: b.objects,
        tags: b.tags,
    }
}

impl Builder {
    fn tag(&mut self, t: &'static str) {
        if !self.tags.contains(&t) {
            self.tags.push(t);
        }
    }

    fn build(&mut self) {
        let n_nodes = self.rng.range(1, 3);
        for i in 0..n_nodes {
            let name = format!("node-{i}");
            let zone = if i % 2 == 0 { "a" } else { "b" };
            self.objects.push(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "zone": zone}}
            }));
            self.nodes.push(name);
        }
        if n_nodes > 1 {
            self.tag("several-nodes");
        }
        if self.rng.chance(0.35) {
            self.drivers.push(NIC);
            self.tag("several-drivers");
        }
        self.taints = self.rng.chance(0.2);
        self.consumable = self.rng.chance(0.2);
        self.classes();

        // Node-local pools.
        let nodes = self.nodes.clone();
        for node in &nodes {
            for driver in self.drivers.clone() {
                if self.rng.chance(0.85) {
                    self.node_pool(driver, node);
                }
            }
        }
        if self.rng.chance(0.2) {
            self.network_pool(true);
        }
        if self.rng.chance(0.15) {
            self.network_pool(false);
        }
        if self.rng.chance(0.25) {
            let node = self.rng.pick(&nodes).clone();
            self.partitionable(&node);
        }
        if self.rng.chance(0.04) {
            self.big_slice();
        }
        if self.rng.chance(0.3) && !self.devices.is_empty() {
            self.in_use_claims();
        }
        let n_claims = if self.rng.chance(0.7) {
            1
        } else {
            self.rng.range(2, 3)
        };
        if n_claims > 1 {
            self.tag("several-claims");
        }
        for i in 0..n_claims {
            self.pod_claim(i);
        }
    }

    fn classes(&mut self) {
        for driver in self.drivers.clone() {
            let mut spec = json!({"selectors": [{"cel": {"expression": format!("device.driver == \"{driver}\"")}}]});
            if self.rng.chance(0.15) {
                spec["config"] =
                    json!([{"opaque": {"driver": driver, "parameters": {"sharing": "none"}}}]);
                self.tag("class-config");
            }
            self.objects.push(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": driver}, "spec": spec
            }));
            self.classes.push((driver.to_owned(), driver));
        }
        if self.rng.chance(0.3) {
            let name = format!("healthy.{GPU}");
            let expression = self
                .rng
                .pick(&[
                    format!(
                        "device.driver == \"{GPU}\" && device.attributes[\"{GPU}\"].healthy == true"
                    ),
                    format!("device.attributes[\"{GPU}\"].model != \"L4\""),
                    format!("device.capacity[\"{GPU}\"].memory.compareTo(quantity(\"40Gi\")) >= 0"),
                ])
                .clone();
            self.objects.push(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": {"selectors": [
                    {"cel": {"expression": format!("device.driver == \"{GPU}\"")}},
                    {"cel": {"expression": expression}}]}
            }));
            self.classes.push((name, GPU));
            self.tag("class-selectors");
        }
    }

    /// Attribute key, qualified with the driver's domain or not (same meaning).
    fn key(&mut self, driver: &str, name: &str) -> String {
        if self.rng.chance(0.5) {
            format!("{driver}/{name}")
        } else {
            name.to_owned()
        }
    }

    fn device(&mut self, driver: &'static str, pool: &str, name: String, index: usize) -> Value {
        let mut attrs = serde_json::Map::new();
        let mut cap = serde_json::Map::new();
        if self.rng.chance(0.9) {
            let m = *self.rng.pick(&MODELS);
            attrs.insert(self.key(driver, "model"), json!({"string": m}));
        }
        attrs.insert(self.key(driver, "index"), json!({"int": index}));
        if self.rng.chance(0.8) {
            let h = self.rng.chance(0.8);
            attrs.insert(self.key(driver, "healthy"), json!({"bool": h}));
        }
        if self.rng.chance(0.85) {
            let numa = self.rng.below(2);
            attrs.insert(self.key(driver, "numa"), json!({"int": numa}));
        }
        if self.rng.chance(0.7) {
            let v = *self.rng.pick(&VERSIONS);
            attrs.insert(self.key(driver, "driverVersion"), json!({"version": v}));
        }
        if self.rng.chance(0.2) {
            // An attribute of another domain.
            attrs.insert(
                "example.com/rack".into(),
                json!({"string": self.rng.pick(&["r1", "r2"]).to_string()}),
            );
        }
        let memory = *self.rng.pick(&MEMORY);
        let mut dev = json!({"name": name});
        let shareable = self.consumable && self.rng.chance(0.5);
        if shareable {
            self.tag("consumable-capacity");
            dev["allowMultipleAllocations"] = json!(true);
            let policy = match self.rng.below(3) {
                0 => {
                    json!({"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi", "max": format!("{memory}Gi")}})
                }
                1 => json!({"default": "2Gi", "validValues": ["1Gi", "2Gi", "4Gi", "8Gi"]}),
                _ => Value::Null,
            };
            let mut m = json!({"value": format!("{memory}Gi")});
            if !policy.is_null() {
                m["requestPolicy"] = policy;
                self.tag("request-policy");
            }
            cap.insert(self.key(driver, "memory"), m);
            if self.rng.chance(0.5) {
                cap.insert(self.key(driver, "cores"), json!({"value": "8"}));
            }
        } else if self.rng.chance(0.9) {
            cap.insert(
                self.key(driver, "memory"),
                json!({"value": format!("{memory}Gi")}),
            );
        }
        if !attrs.is_empty() {
            dev["attributes"] = Value::Object(attrs);
        }
        if !cap.is_empty() {
            dev["capacity"] = Value::Object(cap);
        }
        if self.taints && self.rng.chance(0.4) {
            self.tag("taints");
            let effect = *self.rng.pick(&["NoSchedule", "NoExecute", "None"]);
            let mut taint = json!({"key": self.rng.pick(&["example.com/unhealthy", "maintenance"]).to_string(), "effect": effect});
            if self.rng.chance(0.6) {
                taint["value"] = json!(self.rng.pick(&["true", "soon"]).to_string());
            }
            dev["taints"] = json!([taint]);
        }
        if self.rng.chance(0.08) {
            self.tag("binding-conditions");
            dev["bindingConditions"] = json!(["example.com/ready"]);
            dev["bindingFailureConditions"] = json!(["example.com/failed"]);
            if self.rng.chance(0.5) {
                dev["bindsToNode"] = json!(true);
            }
        }
        self.devices.push(Dev {
            driver,
            pool: pool.to_owned(),
            name: dev["name"].as_str().unwrap_or_default().to_owned(),
            shareable,
            memory: shareable.then_some(memory),
        });
        dev
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "one argument per ResourceSlice field the generator varies"
    )]
    fn slice(
        &mut self,
        driver: &str,
        pool: &str,
        generation: i64,
        count: usize,
        scope: Value,
        devices: Value,
        counters: Option<Value>,
    ) {
        self.slice_n += 1;
        let mut spec = json!({
            "driver": driver,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
        });
        if let (Some(s), Value::Object(scope)) = (spec.as_object_mut(), scope) {
            s.extend(scope);
        }
        match counters {
            Some(c) => spec["sharedCounters"] = c,
            None => spec["devices"] = devices,
        }
        self.objects.push(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": format!("slice-{}", self.slice_n)},
            "spec": spec
        }));
    }

    fn node_pool(&mut self, driver: &'static str, node: &str) {
        let pool = node.to_owned();
        let n_slices = if self.rng.chance(0.8) { 1 } else { 2 };
        let generation = self.rng.range(1, 3) as i64;
        let mut count = n_slices;
        let incomplete = self.rng.chance(0.06);
        if incomplete {
            count += 1;
            self.tag("incomplete-pool");
        }
        let prefix = if driver == GPU { "gpu" } else { "nic" };
        let mut index = 0;
        for _ in 0..n_slices {
            let n = self.rng.range(1, 4);
            let mut devices = Vec::new();
            for _ in 0..n {
                devices.push(self.device(driver, &pool, format!("{prefix}-{index}"), index));
                index += 1;
            }
            self.slice(
                driver,
                &pool,
                generation,
                count,
                json!({"nodeName": node}),
                Value::Array(devices),
                None,
            );
        }
        if n_slices > 1 {
            self.tag("multi-slice-pool");
        }
        if self.rng.chance(0.07) {
            // A slice of an older generation: ignored by the allocator.
            self.tag("obsolete-generation");
            let devices: Vec<Value> = (0..2)
                .map(|i| json!({"name": format!("{prefix}-old-{i}"), "attributes": {"index": {"int": 100 + i}}}))
                .collect();
            self.slice(
                driver,
                &pool,
                generation - 1,
                1,
                json!({"nodeName": node}),
                Value::Array(devices),
                None,
            );
        }
    }

    fn network_pool(&mut self, all_nodes: bool) {
        let (pool, scope) = if all_nodes {
            self.tag("all-nodes-slice");
            ("fabric".to_owned(), json!({"allNodes": true}))
        } else {
            self.tag("node-selector-slice");
            let zone = *self.rng.pick(&["a", "b"]);
            (
                format!("zone-{zone}"),
                json!({"nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": [zone]}]}]}}),
            )
        };
        let n = self.rng.range(1, 3);
        let devices: Vec<Value> = (0..n)
            .map(|i| self.device(GPU, &pool, format!("net-{i}"), 10 + i))
            .collect();
        self.slice(GPU, &pool, 1, 1, scope, Value::Array(devices), None);
    }

    /// A GPU with counters in one slice and its partitions in another (or two others).
    fn partitionable(&mut self, node: &str) {
        self.tag("partitionable");
        let pool = format!("{node}-part");
        let per_device = self.rng.chance(0.3);
        let split = self.rng.chance(0.3);
        let count = if split { 3 } else { 2 };
        let gpus = self.rng.range(1, 2);
        let mut sets = Vec::new();
        for g in 0..gpus {
            sets.push(json!({"name": format!("gpu-{g}-counters"), "counters": {"memory": {"value": "80Gi"}, "slices": {"value": "8"}}}));
        }
        let scope = if per_device {
            json!({"allNodes": true})
        } else {
            json!({"nodeName": node})
        };
        self.slice(
            GPU,
            &pool,
            1,
            count,
            scope.clone(),
            Value::Null,
            Some(Value::Array(sets)),
        );
        let mut parts = Vec::new();
        for g in 0..gpus {
            let set = format!("gpu-{g}-counters");
            for (suffix, mem, slices) in [
                ("", 80, 8),
                ("-half-0", 40, 4),
                ("-half-1", 40, 4),
                ("-q-0", 20, 2),
            ] {
                let name = format!("gpu-{g}{suffix}");
                let mut dev = json!({
                    "name": name,
                    "attributes": {"index": {"int": g}, "model": {"string": "H100"}, format!("{GPU}/numa"): {"int": g}},
                    "capacity": {"memory": {"value": format!("{mem}Gi")}},
                    "consumesCounters": [{"counterSet": set, "counters": {"memory": {"value": format!("{mem}Gi")}, "slices": {"value": slices.to_string()}}}]
                });
                if per_device {
                    self.tag("per-device-node-selection");
                    dev["nodeName"] = json!(node);
                    match self.rng.below(4) {
                        0 => {
                            if let Some(o) = dev.as_object_mut() {
                                o.remove("nodeName");
                            }
                            dev["allNodes"] = json!(true);
                        }
                        1 => {
                            if let Some(o) = dev.as_object_mut() {
                                o.remove("nodeName");
                            }
                            dev["nodeSelector"] = json!({"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]});
                        }
                        _ => {}
                    }
                }
                if self.taints && self.rng.chance(0.2) {
                    dev["taints"] = json!([{"key": "maintenance", "effect": "NoSchedule"}]);
                }
                self.devices.push(Dev {
                    driver: GPU,
                    pool: pool.clone(),
                    name,
                    shareable: false,
                    memory: None,
                });
                parts.push(dev);
            }
        }
        let dev_scope = if per_device {
            json!({"perDeviceNodeSelection": true})
        } else {
            json!({"nodeName": node})
        };
        if split {
            self.tag("counters-across-slices");
            let second = parts.split_off(parts.len() / 2);
            self.slice(
                GPU,
                &pool,
                1,
                count,
                dev_scope.clone(),
                Value::Array(parts),
                None,
            );
            self.slice(GPU, &pool, 1, count, dev_scope, Value::Array(second), None);
        } else {
            self.slice(GPU, &pool, 1, count, dev_scope, Value::Array(parts), None);
        }
    }

    /// More than 32 matching devices on one node: `All` hits the result limit.
    fn big_slice(&mut self) {
        self.tag("many-devices");
        let node = self.nodes[0].clone();
        let n = self.rng.range(30, 40);
        let devices: Vec<Value> = (0..n)
            .map(|i| json!({"name": format!("big-{i}"), "attributes": {"index": {"int": i}}}))
            .collect();
        self.slice(
            GPU,
            "big",
            1,
            1,
            json!({"nodeName": node}),
            Value::Array(devices),
            None,
        );
        for i in 0..n {
            self.devices.push(Dev {
                driver: GPU,
                pool: "big".into(),
                name: format!("big-{i}"),
                shareable: false,
                memory: None,
            });
        }
    }

    fn in_use_claims(&mut self) {
        self.tag("in-use-claims");
        let n = self.rng.range(1, 2);
        for k in 0..n {
            let m = self.rng.range(1, 2);
            let mut requests = Vec::new();
            let mut results = Vec::new();
            let mut used = Vec::new();
            for j in 0..m {
                let d = self.rng.pick(&self.devices).clone();
                if used.contains(&(d.pool.clone(), d.name.clone())) {
                    continue;
                }
                used.push((d.pool.clone(), d.name.clone()));
                let req = format!("r{j}");
                let admin = self.rng.chance(0.1);
                let mut exactly = json!({"deviceClassName": d.driver});
                let mut result =
                    json!({"request": req, "driver": d.driver, "pool": d.pool, "device": d.name});
                if admin {
                    self.tag("admin-access");
                    exactly["adminAccess"] = json!(true);
                    result["adminAccess"] = json!(true);
                }
                if d.shareable {
                    self.tag("shared-in-use");
                    result["shareID"] = json!(self.rng.uuid());
                    let gi = self.rng.range(1, d.memory.unwrap_or(1) as usize / 2 + 1);
                    result["consumedCapacity"] = json!({"memory": format!("{gi}Gi")});
                }
                requests.push(json!({"name": req, "exactly": exactly}));
                results.push(result);
            }
            let mut status = json!({"allocation": {"devices": {"results": results}}});
            if self.rng.chance(0.5) {
                status["reservedFor"] = json!([{"resource": "pods", "name": format!("user-{k}"), "uid": self.rng.uuid()}]);
            }
            self.objects.push(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": format!("used-{k}"), "namespace": "other", "uid": self.rng.uuid()},
                "spec": {"devices": {"requests": requests}},
                "status": status
            }));
        }
    }

    fn selector(&mut self, driver: &str) -> String {
        let d = driver;
        if self.rng.chance(0.03) {
            self.tag("cel-runtime-error");
            return format!("device.attributes[\"{d}\"].nosuch == \"x\"");
        }
        self.tag("request-selectors");
        let choices = [
            format!(
                "device.attributes[\"{d}\"].model == \"{}\"",
                self.rng.pick(&MODELS)
            ),
            format!("device.attributes[\"{d}\"].index >= {}", self.rng.below(3)),
            format!(
                "has(device.attributes[\"{d}\"].healthy) && device.attributes[\"{d}\"].healthy"
            ),
            format!(
                "has(device.attributes[\"{d}\"].driverVersion) && device.attributes[\"{d}\"].driverVersion.isGreaterThan(semver(\"1.1.0\"))"
            ),
            format!(
                "has(device.capacity[\"{d}\"].memory) && device.capacity[\"{d}\"].memory.compareTo(quantity(\"{}Gi\")) >= 0",
                self.rng.pick(&MEMORY)
            ),
            format!("device.attributes[\"{d}\"].model.startsWith(\"H\")"),
            format!(
                "!has(device.attributes[\"{d}\"].numa) || device.attributes[\"{d}\"].numa == 0"
            ),
            "device.allowMultipleAllocations == true".to_string(),
            format!("device.driver == \"{d}\""),
        ];
        self.rng.pick(&choices).clone()
    }

    fn tolerations(&mut self) -> Value {
        self.tag("tolerations");
        let n = self.rng.range(1, 2);
        let mut out = Vec::new();
        for _ in 0..n {
            let mut t = serde_json::Map::new();
            match self.rng.below(5) {
                0 => {
                    t.insert("operator".into(), json!("Exists"));
                }
                1 => {
                    t.insert("key".into(), json!("example.com/unhealthy"));
                    t.insert("operator".into(), json!("Exists"));
                }
                2 => {
                    t.insert("key".into(), json!("example.com/unhealthy"));
                    t.insert("value".into(), json!("true"));
                }
                3 => {
                    t.insert("key".into(), json!("maintenance"));
                    t.insert("operator".into(), json!("Equal"));
                    t.insert(
                        "value".into(),
                        json!(self.rng.pick(&["soon", "true", ""]).to_string()),
                    );
                }
                _ => {
                    t.insert("key".into(), json!("maintenance"));
                    t.insert("operator".into(), json!("Exists"));
                }
            }
            if self.rng.chance(0.5) {
                t.insert(
                    "effect".into(),
                    json!(self.rng.pick(&["NoSchedule", "NoExecute"]).to_string()),
                );
            }
            out.push(Value::Object(t));
        }
        Value::Array(out)
    }

    /// The body of an `exactly` request or a subrequest.
    fn exact(&mut self, allow_admin: bool) -> Value {
        let (class, driver) = if self.rng.chance(0.02) {
            self.tag("unknown-class");
            ("missing.example.com".to_owned(), GPU)
        } else {
            self.rng.pick(&self.classes).clone()
        };
        let mut e = json!({"deviceClassName": class});
        match self.rng.below(10) {
            0 => {
                self.tag("mode-all");
                e["allocationMode"] = json!("All");
            }
            1 | 2 => {
                self.tag("count");
                e["count"] = json!(self.rng.range(2, 3));
            }
            3 => {
                e["allocationMode"] = json!("ExactCount");
            }
            _ => {}
        }
        if self.devices.iter().any(|d| d.name.starts_with("big-")) && self.rng.chance(0.5) {
            if self.rng.chance(0.5) {
                e["allocationMode"] = json!("All");
                if let Some(o) = e.as_object_mut() {
                    o.remove("count");
                }
            } else {
                e["allocationMode"] = json!("ExactCount");
                e["count"] = json!(self.rng.range(31, 34));
            }
        }
        if self.rng.chance(0.45) {
            let n = self.rng.range(1, 2);
            let sels: Vec<Value> = (0..n)
                .map(|_| json!({"cel": {"expression": self.selector(driver)}}))
                .collect();
            e["selectors"] = Value::Array(sels);
        }
        if self.taints && self.rng.chance(0.6) {
            e["tolerations"] = self.tolerations();
        }
        if allow_admin && self.rng.chance(0.06) {
            self.tag("admin-access");
            e["adminAccess"] = json!(true);
        }
        if self.consumable && self.rng.chance(0.6) {
            self.tag("capacity-requests");
            let q = *self
                .rng
                .pick(&["1Gi", "2Gi", "3Gi", "1536Mi", "10Gi", "30Gi", "500Mi"]);
            let key = if self.rng.chance(0.5) {
                "memory".to_owned()
            } else {
                format!("{driver}/memory")
            };
            e["capacity"] = json!({"requests": {key: q}});
        }
        e
    }

    fn pod_claim(&mut self, i: usize) {
        let n_req = self.rng.range(1, 3);
        let mut requests = Vec::new();
        let mut names: Vec<String> = Vec::new();
        for r in 0..n_req {
            let name = format!("req-{r}");
            if self.rng.chance(0.25) {
                self.tag("first-available");
                let n_sub = self.rng.range(1, 3);
                let mut subs = Vec::new();
                for s in 0..n_sub {
                    let mut sub = self.exact(false);
                    sub["name"] = json!(format!("sub-{s}"));
                    names.push(format!("{name}/sub-{s}"));
                    subs.push(sub);
                }
                requests.push(json!({"name": name, "firstAvailable": subs}));
            } else {
                requests.push(json!({"name": name, "exactly": self.exact(true)}));
            }
            names.push(name);
        }
        let mut devices = json!({"requests": requests});
        if self.rng.chance(0.35) {
            let n = self.rng.range(1, 2);
            let mut constraints = Vec::new();
            for _ in 0..n {
                let attr = self
                    .rng
                    .pick(&["numa", "model", "index", "driverVersion", "healthy"])
                    .to_string();
                let domain = if self.rng.chance(0.9) { GPU } else { NIC };
                let mut c = if self.rng.chance(0.6) {
                    self.tag("match-attribute");
                    json!({"matchAttribute": format!("{domain}/{attr}")})
                } else {
                    self.tag("distinct-attribute");
                    json!({"distinctAttribute": format!("{domain}/{attr}")})
                };
                if self.rng.chance(0.5) && names.len() > 1 {
                    let k = self.rng.range(1, names.len().min(3));
                    let mut refs: Vec<String> = Vec::new();
                    for _ in 0..k {
                        let n = self.rng.pick(&names).clone();
                        if !refs.contains(&n) {
                            refs.push(n);
                        }
                    }
                    c["requests"] = json!(refs);
                }
                constraints.push(c);
            }
            devices["constraints"] = Value::Array(constraints);
        }
        if self.rng.chance(0.15) {
            self.tag("claim-config");
            let mut c = json!({"opaque": {"driver": GPU, "parameters": {"mode": "exclusive"}}});
            if self.rng.chance(0.5) {
                c["requests"] = json!([self.rng.pick(&names).clone()]);
            }
            devices["config"] = json!([c]);
        }
        let mut meta = json!({"name": format!("claim-{i}")});
        if self.rng.chance(0.5) {
            meta["namespace"] = json!("team");
        }
        self.objects.push(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": meta, "spec": {"devices": devices}
        }));
    }
}
