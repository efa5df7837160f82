// celcost: a MutatingAdmissionPolicy's cost inside the apiserver, measured with the
// apiserver's own compile and evaluation code (k8s.io/apiserver v0.37.2, the version of the
// harness's kube-apiserver): the match conditions, then each mutation as the dispatcher
// runs it (CEL with cost tracking, the JSON patch: encode, apply, strict decode), on one
// pod in a loop. What it leaves out costs any mutating policy alike (the reinvocation
// pass, conversion, defaulting). CPU time per pod is robust to the machine's other load;
// wall times are not. bench/celcost/policy_cost.py drives it.
//
//	cd bench/celcost && GOFLAGS=-mod=mod GOPROXY=off go build -o celcost .
//	./celcost ITERATIONS POD.json POLICY.json [POLICY.json...]   # ITERATIONS 0: output only
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime/pprof"
	"syscall"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/admission"
	plugincel "k8s.io/apiserver/pkg/admission/plugin/cel"
	"k8s.io/apiserver/pkg/admission/plugin/policy/mutating/patch"
	"k8s.io/apiserver/pkg/admission/plugin/policy/validating"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/cel/environment"
	"k8s.io/client-go/kubernetes/scheme"
)

type evaluator struct {
	matcher  matchconditions.Matcher
	patchers []patch.Patcher
	compiler *plugincel.CompositedCompiler
}

func compile(policy *admissionregistrationv1.MutatingAdmissionPolicy) evaluator {
	opts := plugincel.OptionalVariableDeclarations{HasParams: policy.Spec.ParamKind != nil, HasAuthorizer: true}
	compiler, err := plugincel.NewCompositedCompiler(environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion()))
	if err != nil {
		panic(err)
	}
	vars := make([]plugincel.NamedExpressionAccessor, len(policy.Spec.Variables))
	for i, v := range policy.Spec.Variables {
		vars[i] = &validating.Variable{Name: v.Name, Expression: v.Expression}
	}
	compiler.CompileAndStoreVariables(vars, opts, environment.StoredExpressions)
	var matcher matchconditions.Matcher
	if mc := policy.Spec.MatchConditions; len(mc) > 0 {
		acc := make([]plugincel.ExpressionAccessor, len(mc))
		for i := range mc {
			acc[i] = (*matchconditions.MatchCondition)(&mc[i])
		}
		matcher = matchconditions.NewMatcher(compiler.CompileCondition(acc, opts, environment.StoredExpressions), policy.Spec.FailurePolicy, "policy", "validate", policy.Name)
	}
	po := opts
	po.HasPatchTypes = true
	var patchers []patch.Patcher
	for _, m := range policy.Spec.Mutations {
		res := compiler.CompileMutatingEvaluator(&patch.JSONPatchCondition{Expression: m.JSONPatch.Expression}, po, environment.StoredExpressions)
		if errs := res.CompilationErrors(); len(errs) > 0 {
			panic(fmt.Sprint(errs))
		}
		patchers = append(patchers, patch.NewJSONPatcher(res))
	}
	return evaluator{matcher, patchers, compiler}
}

// compileValidating is validating.compilePolicy (unexported) for a policy without params.
func compileValidating(policy *admissionregistrationv1.ValidatingAdmissionPolicy) validating.Validator {
	opts := plugincel.OptionalVariableDeclarations{HasParams: false, HasAuthorizer: true}
	msgOpts := plugincel.OptionalVariableDeclarations{HasParams: false, HasAuthorizer: false}
	compiler, err := plugincel.NewCompositedCompiler(environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion()))
	if err != nil {
		panic(err)
	}
	vars := make([]plugincel.NamedExpressionAccessor, len(policy.Spec.Variables))
	for i, v := range policy.Spec.Variables {
		vars[i] = &validating.Variable{Name: v.Name, Expression: v.Expression}
	}
	compiler.CompileAndStoreVariables(vars, opts, environment.StoredExpressions)
	var matcher matchconditions.Matcher
	if mc := policy.Spec.MatchConditions; len(mc) > 0 {
		acc := make([]plugincel.ExpressionAccessor, len(mc))
		for i := range mc {
			acc[i] = (*matchconditions.MatchCondition)(&mc[i])
		}
		matcher = matchconditions.NewMatcher(compiler.CompileCondition(acc, opts, environment.StoredExpressions), policy.Spec.FailurePolicy, "policy", "validate", policy.Name)
	}
	validations := make([]plugincel.ExpressionAccessor, len(policy.Spec.Validations))
	messages := make([]plugincel.ExpressionAccessor, len(policy.Spec.Validations))
	for i, v := range policy.Spec.Validations {
		validations[i] = &validating.ValidationCondition{Expression: v.Expression, Message: v.Message, Reason: v.Reason}
		if v.MessageExpression != "" {
			messages[i] = &validating.MessageExpressionCondition{MessageExpression: v.MessageExpression}
		}
	}
	return validating.NewValidator(
		compiler.CompileCondition(validations, opts, environment.StoredExpressions),
		matcher,
		compiler.CompileCondition(nil, opts, environment.StoredExpressions),
		compiler.CompileCondition(messages, msgOpts, environment.StoredExpressions),
		policy.Spec.FailurePolicy,
		nil,
	)
}

func main() {
	// usage: celbench ITERATIONS POD.json POLICY.json [POLICY.json...]
	// Runs the policies in order on the pod (each: match conditions, then its mutations),
	// ITERATIONS times after a warm-up; prints the final pod on stdout, costs on stderr.
	var n int
	fmt.Sscan(os.Args[1], &n)
	var pod corev1.Pod
	must(json.Unmarshal(read(os.Args[2]), &pod))
	// Mutating policies run in the order given; validating ones (kind
	// ValidatingAdmissionPolicy) after all of them, on the mutated pod: their refusals are
	// printed after the pod, one line each.
	var evs []evaluator
	var vals []validating.Validator
	for _, f := range os.Args[3:] {
		var kind metav1.TypeMeta
		must(json.Unmarshal(read(f), &kind))
		if kind.Kind == "ValidatingAdmissionPolicy" {
			var policy admissionregistrationv1.ValidatingAdmissionPolicy
			must(json.Unmarshal(read(f), &policy))
			vals = append(vals, compileValidating(&policy))
			continue
		}
		var policy admissionregistrationv1.MutatingAdmissionPolicy
		must(json.Unmarshal(read(f), &policy))
		evs = append(evs, compile(&policy))
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench", Labels: map[string]string{"kubernetes.io/metadata.name": "bench"}}}
	if labels := os.Getenv("NAMESPACE_LABELS"); labels != "" { // JSON, e.g. a Pod Security level
		must(json.Unmarshal([]byte(labels), &ns.Labels))
	}
	gvk := schema.GroupVersionKind{Version: "v1", Kind: "Pod"}
	gvr := schema.GroupVersionResource{Version: "v1", Resource: "pods"}
	oi := admission.NewObjectInterfacesFromScheme(scheme.Scheme)
	// The mutating policies' param (their binding's paramRef: the network), JSON.
	var params runtime.Object
	if text := os.Getenv("PARAMS"); text != "" {
		object := map[string]interface{}{}
		must(json.Unmarshal([]byte(text), &object))
		params = &unstructured.Unstructured{Object: object}
	}
	run := func() (time.Duration, time.Duration, []byte) {
		var tm, tp time.Duration
		var cur runtime.Object = pod.DeepCopy()
		for _, ev := range evs {
			attr := admission.NewAttributesRecord(cur, nil, gvk, "bench", "p", gvr, "", admission.Create, &metav1.CreateOptions{}, false, &user.DefaultInfo{Name: "admin"})
			va := &admission.VersionedAttributes{Attributes: attr, VersionedKind: gvk, VersionedObject: admission.NewLazyObject(cur)}
			ctx := ev.compiler.CreateContext(context.Background())
			t0 := time.Now()
			if ev.matcher != nil {
				r := ev.matcher.Match(ctx, va, params, nil)
				if r.Error != nil {
					panic(r.Error)
				}
				tm += time.Since(t0)
				if !r.Matches {
					continue
				}
			}
			t1 := time.Now()
			for _, pt := range ev.patchers {
				req := patch.Request{MatchedResource: gvr, VersionedAttributes: va, ObjectInterfaces: oi, Namespace: ns, OptionalVariables: plugincel.OptionalVariableBindings{VersionedParams: params}}
				obj, err := pt.Patch(ctx, req, celconfig.RuntimeCELCostBudget)
				if err != nil {
					panic(err)
				}
				va.UpdateObject(obj)
				cur = obj
			}
			tp += time.Since(t1)
		}
		out, _ := json.Marshal(cur)
		t2 := time.Now()
		for _, v := range vals {
			attr := admission.NewAttributesRecord(cur, nil, gvk, "bench", "p", gvr, "", admission.Create, &metav1.CreateOptions{}, false, &user.DefaultInfo{Name: "admin"})
			va := &admission.VersionedAttributes{Attributes: attr, VersionedKind: gvk, VersionedObject: admission.NewLazyObject(cur)}
			res := v.Validate(context.Background(), gvr, va, nil, ns, celconfig.RuntimeCELCostBudget, nil)
			for _, d := range res.Decisions {
				if d.Action != validating.ActionAdmit {
					out = append(out, []byte(fmt.Sprintf("\n%s %s %s", d.Action, d.Reason, d.Message))...)
				}
			}
		}
		tp += time.Since(t2)
		return tm, tp, out
	}
	_, _, out := run()
	os.Stdout.Write(out)
	if n == 0 {
		return
	}
	for i := 0; i < 300; i++ {
		run()
	}
	if f := os.Getenv("CPUPROFILE"); f != "" {
		w, _ := os.Create(f)
		pprof.StartCPUProfile(w)
		defer pprof.StopCPUProfile()
	}
	cpu := func() time.Duration {
		var ru syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	var tm, tp time.Duration
	c0 := cpu()
	for i := 0; i < n; i++ {
		m, p, _ := run()
		tm += m
		tp += p
	}
	c1 := cpu()
	fmt.Fprintf(os.Stderr, "match %.1f us, patch %.1f us, cpu %.1f us (per pod, %d runs)\n", float64(tm.Microseconds())/float64(n), float64(tp.Microseconds())/float64(n), float64((c1-c0).Microseconds())/float64(n), n)
}

func read(p string) []byte { b, err := os.ReadFile(p); must(err); return b }
func must(err error) {
	if err != nil {
		panic(err)
	}
}
